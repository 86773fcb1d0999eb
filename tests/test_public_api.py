"""The public surface, listed: changing it is a decision, not an accident."""

from __future__ import annotations

import pytest

import multigpu
from multigpu.cli.main import subcommands

PUBLIC = {
    "reduce_value",
    "launch",
    "launch_function",
    "is_main_process",
    "SessionConfig",
    "Session",
    "LaunchError",
    "LaunchTimeoutError",
    "ResultError",
    "LaunchConfig",
    "CheckpointError",
    "Checkpointer",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DataParallel",
    "DDPOptions",
    "FSDPOptions",
    "DeviceError",
    "DeviceMemory",
    "GatherError",
    "MultigpuError",
    "PeerExitedError",
    "PlacementError",
    "ProfileConfig",
    "ReplicaDevice",
    "Resumed",
    "ScatterError",
    "clean_state_dict",
    "data_parallel",
    "find_latest",
    "load",
    "parse_devices",
    "profile_steps",
    "save",
    "track_memory",
    "unwrap",
}

PARALLEL = {"DataParallel", "data_parallel", "gather", "parallel_apply", "replicate", "scatter"}

COMMANDS = {"advise", "bandwidth", "ckpt", "demo", "env", "launch", "profile"}


def test_package_exports() -> None:
    assert set(multigpu.__all__) == PUBLIC
    assert set(dir(multigpu)) >= PUBLIC  # the names are imported on first use: dir() lists them before
    assert all(hasattr(multigpu, name) for name in PUBLIC)


def test_names_imported_on_first_use_are_the_library_objects() -> None:
    from multigpu.parallel import DataParallel
    from multigpu.profiling.memory import track_memory

    assert multigpu.DataParallel is DataParallel and multigpu.track_memory is track_memory
    with pytest.raises(AttributeError, match="no attribute 'DataParalel'"):
        multigpu.DataParalel  # type: ignore[attr-defined]  # noqa: B018  # the misspelling is the test


def test_parallel_exports_torch_nn_parallels_functional_primitives() -> None:
    import multigpu.parallel

    assert set(multigpu.parallel.__all__) == PARALLEL
    assert all(callable(getattr(multigpu.parallel, name)) for name in PARALLEL)


def test_subcommands() -> None:
    found = subcommands()
    assert set(found) == COMMANDS
    assert all(module.HELP and module.__doc__ for module in found.values())


def test_session_token_weighting_surface() -> None:
    import inspect

    from multigpu.session import Session

    backward = inspect.signature(Session.backward).parameters
    assert list(backward) == ["self", "loss", "num_items"]
    assert backward["num_items"].kind is inspect.Parameter.KEYWORD_ONLY
    assert isinstance(Session.window_loss, property)


def test_session_activation_checkpointing_surface() -> None:
    from dataclasses import fields

    from multigpu.session import SessionConfig

    assert "activation_checkpointing" in {f.name for f in fields(SessionConfig)}
    assert SessionConfig().activation_checkpointing is None
