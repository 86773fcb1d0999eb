"""Each strategy's facts, as the Session, the launcher, the CLI and the planner ask them (multigpu.strategies)."""

from __future__ import annotations

import pytest

from multigpu.devices import get_device_type
from multigpu.errors import ConfigError
from multigpu.launcher.launch import LAUNCH_STRATEGIES, LaunchConfig, worker_env
from multigpu.session import SessionConfig
from multigpu.strategies import (
    STRATEGIES,
    DDPOptions,
    FSDPOptions,
    get_strategy,
    multi_device_strategies,
    process_strategies,
    strategy_labels,
)


def test_the_names_every_report_uses_with_their_labels() -> None:
    assert strategy_labels() == {
        "single": "single device",
        "dp": "DataParallel",
        "dp-balanced": "balanced DataParallel",
        "ddp": "DDP",
        "fsdp": "FSDP",
    }
    assert process_strategies() == ("ddp", "fsdp")
    assert multi_device_strategies() == ("dp", "dp-balanced", "ddp", "fsdp")


def test_the_launcher_offers_every_strategy_and_auto() -> None:
    assert ("auto", *STRATEGIES) == LAUNCH_STRATEGIES


def test_options_types_are_the_session_config_fields_named_as_their_strategy() -> None:
    assert {name: cls.options_type for name, cls in STRATEGIES.items() if cls.options_type} == {
        "ddp": DDPOptions,
        "fsdp": FSDPOptions,
    }
    with pytest.raises(ConfigError, match=r"fsdp=.* must be a FSDPOptions; use e\.g\. fsdp=FSDPOptions\(\)"):
        SessionConfig(fsdp=DDPOptions())  # type: ignore[arg-type]


def test_only_fsdp_asks_for_a_launch_environment_and_the_launcher_sets_it() -> None:
    cpu = get_device_type("cpu")
    clean = {"PATH": "/bin"}  # no malloc setting of the user's own
    assert {name: cls.launch_env(cpu, clean) for name, cls in STRATEGIES.items()} == {
        "single": {},
        "dp": {},
        "ddp": {},
        "fsdp": cpu.sharded_process_env(clean),
    }
    assert get_strategy("fsdp").launch_env(cpu, clean) == cpu.sharded_process_env(clean)
    assert worker_env(LaunchConfig(strategy="single"), "single", 1).keys().isdisjoint(cpu.sharded_process_env(clean))


def test_which_strategies_need_processes_and_which_take_launch_devices() -> None:
    assert [name for name, cls in STRATEGIES.items() if cls.needs_processes] == ["ddp", "fsdp"]
    assert [name for name, cls in STRATEGIES.items() if cls.launch_devices] == ["dp"]
    with pytest.raises(ConfigError, match=r"strategy='zero3' is not one of \['auto', 'single', 'dp', 'ddp', 'fsdp'\]"):
        get_strategy("zero3")
