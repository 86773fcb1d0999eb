"""multigpu: train one PyTorch model on several devices with data parallelism.

    model = multigpu.DataParallel(model, device_ids=[0, 1])   # or devices="cpu:2"

See the README for the full picture: balanced memory, DDP through ``multigpu launch``,
checkpoints that load anywhere, and measured numbers.
"""

from multigpu.checkpoint import Checkpointer, Resumed, clean_state_dict, find_latest, load, save, unwrap
from multigpu.devices import ReplicaDevice, parse_devices
from multigpu.distributed import LaunchConfig, is_main_process, launch, reduce_value
from multigpu.errors import (
    CheckpointError,
    CollectiveTimeoutError,
    ConfigError,
    DeviceError,
    GatherError,
    LaunchError,
    MultigpuError,
    PeerExitedError,
    PlacementError,
    ScatterError,
)
from multigpu.parallel import DataParallel, data_parallel
from multigpu.profiling.memory import DeviceMemory, track_memory
from multigpu.profiling.step import ProfileConfig, profile_steps
from multigpu.session import DDPOptions, FSDPOptions, Session, SessionConfig

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Checkpointer",
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
    "MultigpuError",
    "PeerExitedError",
    "PlacementError",
    "ProfileConfig",
    "ReplicaDevice",
    "Resumed",
    "ScatterError",
    "Session",
    "SessionConfig",
    "clean_state_dict",
    "data_parallel",
    "find_latest",
    "is_main_process",
    "launch",
    "load",
    "parse_devices",
    "profile_steps",
    "reduce_value",
    "save",
    "track_memory",
    "unwrap",
]
