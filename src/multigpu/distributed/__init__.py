"""The multi-process engine on torch.distributed: runtime, launch, sharded data, collectives."""

from multigpu.distributed.collectives import gather_by_index, reduce_value
from multigpu.distributed.data import EpochLoader, ShardSpec, build_epoch_loader, even_batches
from multigpu.distributed.failures import explain_collective_failures
from multigpu.distributed.launch import LaunchConfig, launch
from multigpu.distributed.runtime import (
    LaunchEnv,
    LaunchError,
    barrier,
    is_main_process,
    read_launch_env,
    setup_process_group,
    teardown_process_group,
)

__all__ = [
    "EpochLoader",
    "LaunchConfig",
    "LaunchEnv",
    "LaunchError",
    "ShardSpec",
    "barrier",
    "build_epoch_loader",
    "even_batches",
    "explain_collective_failures",
    "gather_by_index",
    "is_main_process",
    "launch",
    "read_launch_env",
    "reduce_value",
    "setup_process_group",
    "teardown_process_group",
]
