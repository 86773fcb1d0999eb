"""Each strategy's facts, as the Session, the launcher, the CLI and the planner ask them (multigpu.strategies)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from multigpu.devices import get_device_type, parse_devices
from multigpu.errors import ConfigError, LaunchError
from multigpu.launcher.config import LAUNCH_STRATEGIES, LaunchConfig
from multigpu.launcher.launch import worker_env
from multigpu.runtime.data import ShardSpec
from multigpu.runtime.world import LaunchEnv
from multigpu.session import SessionConfig
from multigpu.strategies import (
    STRATEGIES,
    DDPOptions,
    FSDPOptions,
    build_strategy,
    get_strategy,
    multi_device_strategies,
    process_strategies,
    strategy_labels,
)
from multigpu.strategies.ddp import DDPStrategy
from multigpu.strategies.dp import DataParallelStrategy
from multigpu.strategies.fsdp import FSDPStrategy
from multigpu.strategies.single import SingleStrategy


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


# -- made from plain values; build() reads the process ---------------------------------------------

_RANK_1_OF_4 = LaunchEnv(
    global_rank=1, local_rank=1, world_size=4, local_world_size=2, master_addr="127.0.0.1", master_port=29500
)


def test_a_strategy_is_made_from_plain_values_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MULTIGPU_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    ddp = DDPStrategy(env=_RANK_1_OF_4, device=torch.device("cpu"), timeout_s=5.0)  # nothing read here
    assert (ddp.shard, ddp.local_rank, ddp.is_main_process) == (ShardSpec(world_size=4, rank=1), 1, False)
    assert ddp.options == DDPOptions() and ddp.timeout_s == 5.0 and ddp.precision_name == "fp32"
    fsdp = FSDPStrategy(env=_RANK_1_OF_4, device=torch.device("cpu"), options=FSDPOptions(max_share=0.5))
    assert fsdp.options.max_share == 0.5 and fsdp.device == torch.device("cpu")
    dp = DataParallelStrategy(replicas=parse_devices("cpu:3"), precision="bf16")
    assert dp.replicas_per_process == 3 and dp.device == torch.device("cpu") and dp.precision_name == "bf16"
    assert SingleStrategy(device=torch.device("meta")).device == torch.device("meta")


def test_build_reads_the_launch_and_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MULTIGPU_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(LaunchError, match=r"strategy 'ddp' needs a launched process"):
        DDPStrategy.build()
    with pytest.raises(ConfigError, match=r"devices='cpu:2' names 2; use strategy='dp'"):
        SingleStrategy.build(devices="cpu:2")
    assert DataParallelStrategy.build().replicas_per_process == 2  # no GPU here: two CPU replicas
    monkeypatch.setenv("MULTIGPU_DEVICES", "cpu:3")  # multigpu launch --strategy dp --devices cpu:3
    assert DataParallelStrategy.build().replicas_per_process == 3
    # torchrun's variables on the second of two nodes (MASTER_ADDR too: without it the nodes could not meet)
    launched = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0"}
    for key, value in launched.items():
        monkeypatch.setenv(key, value)
    built = FSDPStrategy.build(devices="cpu:2", precision="bf16", options=FSDPOptions(max_share=0.5))
    assert (built.env.global_rank, built.local_rank, built.device) == (1, 1, torch.device("cpu"))
    assert built.options.max_share == 0.5 and built.precision_name == "bf16"
    assert build_strategy("ddp", ddp=DDPOptions(comm_hook="bf16"), fsdp=FSDPOptions()).options.comm_hook == "bf16"


def test_fsdp_shards_in_its_precision_whatever_the_order_of_the_calls(one_rank_group: None) -> None:
    """The precision is the strategy's from the start: wrapping before build_precision still computes in bf16."""
    one_rank = LaunchEnv(
        global_rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1", master_port=29500
    )
    strategy = FSDPStrategy(env=one_rank, device=torch.device("cpu"), precision="bf16")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the process was not started with fsdp's malloc setting
        wrapped = strategy.wrap_model(model)
    precision = strategy.build_precision()  # after wrapping: the order the old coupling got wrong
    with precision.autocast():
        out = wrapped(torch.randn(3, 4))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32  # blocks in bf16; the root returns float32
    assert precision.name == "bf16"
