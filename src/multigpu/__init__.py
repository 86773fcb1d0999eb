"""multigpu: train one PyTorch model on several devices with data parallelism.

    model = multigpu.DataParallel(model, device_ids=[0, 1])   # or devices="cpu:2"

See the README for the full picture: balanced memory, DDP through ``multigpu launch``,
checkpoints that load anywhere, and measured numbers.
"""

from multigpu.checkpoint import clean_state_dict, unwrap
from multigpu.devices import ReplicaDevice, parse_devices
from multigpu.errors import (
    CheckpointError,
    ConfigError,
    DeviceError,
    GatherError,
    MultigpuError,
    PlacementError,
    ScatterError,
)
from multigpu.parallel import DataParallel

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataParallel",
    "DeviceError",
    "GatherError",
    "MultigpuError",
    "PlacementError",
    "ReplicaDevice",
    "ScatterError",
    "clean_state_dict",
    "parse_devices",
    "unwrap",
]
