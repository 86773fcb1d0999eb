"""multigpu: train one PyTorch model on several devices with data parallelism.

    model = multigpu.DataParallel(model, device_ids=[0, 1])   # or devices="cpu:2"

See the README for the full picture: balanced memory, DDP through ``multigpu launch``,
checkpoints that load anywhere, and measured numbers.

The public names are imported on first use (``multigpu.DataParallel`` imports torch then), so
``import multigpu`` and ``multigpu --help`` stay fast; ``from multigpu import X`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from multigpu.checkpoint import Checkpointer, Resumed, clean_state_dict, find_latest, load, save, unwrap
    from multigpu.devices import ReplicaDevice, parse_devices
    from multigpu.errors import (
        CheckpointError,
        CollectiveMismatchError,
        CollectiveTimeoutError,
        ConfigError,
        DeviceError,
        GatherError,
        LaunchError,
        LaunchTimeoutError,
        MultigpuError,
        PeerExitedError,
        PlacementError,
        ResultError,
        ScatterError,
    )
    from multigpu.launcher import LaunchConfig, launch, launch_function
    from multigpu.parallel import DataParallel, data_parallel
    from multigpu.profiling.memory import DeviceMemory, track_memory
    from multigpu.profiling.step import ProfileConfig, profile_steps
    from multigpu.runtime import is_main_process, reduce_value
    from multigpu.session import DDPOptions, FSDPOptions, Session, SessionConfig

_ERRORS = (
    "CheckpointError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DeviceError",
    "GatherError",
    "LaunchError",
    "LaunchTimeoutError",
    "MultigpuError",
    "PeerExitedError",
    "PlacementError",
    "ResultError",
    "ScatterError",
)

# public name -> the module it comes from (the same imports as the TYPE_CHECKING block above)
_SOURCES: dict[str, str] = {
    **dict.fromkeys(
        ("Checkpointer", "Resumed", "clean_state_dict", "find_latest", "load", "save", "unwrap"), "multigpu.checkpoint"
    ),
    **dict.fromkeys(("ReplicaDevice", "parse_devices"), "multigpu.devices"),
    **dict.fromkeys(("LaunchConfig", "launch", "launch_function"), "multigpu.launcher"),
    **dict.fromkeys(_ERRORS, "multigpu.errors"),
    **dict.fromkeys(("DataParallel", "data_parallel"), "multigpu.parallel"),
    **dict.fromkeys(("DeviceMemory", "track_memory"), "multigpu.profiling.memory"),
    **dict.fromkeys(("ProfileConfig", "profile_steps"), "multigpu.profiling.step"),
    **dict.fromkeys(("is_main_process", "reduce_value"), "multigpu.runtime"),
    **dict.fromkeys(("DDPOptions", "FSDPOptions", "Session", "SessionConfig"), "multigpu.session"),
}

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DDPOptions",
    "DataParallel",
    "DeviceError",
    "DeviceMemory",
    "FSDPOptions",
    "GatherError",
    "LaunchConfig",
    "LaunchError",
    "LaunchTimeoutError",
    "MultigpuError",
    "PeerExitedError",
    "PlacementError",
    "ProfileConfig",
    "ReplicaDevice",
    "ResultError",
    "Resumed",
    "ScatterError",
    "Session",
    "SessionConfig",
    "clean_state_dict",
    "data_parallel",
    "find_latest",
    "is_main_process",
    "launch",
    "launch_function",
    "load",
    "parse_devices",
    "profile_steps",
    "reduce_value",
    "save",
    "track_memory",
    "unwrap",
]


def _import_on_first_use(name: str) -> Any:
    """Import a public name on first use (PEP 562) and keep it, so the next access is a plain lookup."""
    if name == "__version__":
        from multigpu.core.version import installed_version

        value: Any = installed_version()
    elif name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name]), name)
    else:
        raise AttributeError(f"module 'multigpu' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})


if TYPE_CHECKING:
    __version__: str
else:  # hidden from type checkers, which see the imports above: a misspelt name stays an error there
    __getattr__ = _import_on_first_use
