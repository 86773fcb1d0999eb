"""The worker's side of torch.distributed: this process's place in the run, collectives, sharded data.

- :mod:`~multigpu.runtime.world`: the one reader of the launcher's variables (``RANK``,
  ``WORLD_SIZE``, ...), the process group, "which rank am I".
- :mod:`~multigpu.runtime.collectives`: metric reduction and per-sample gathers.
- :mod:`~multigpu.runtime.data` and :mod:`~multigpu.runtime.loaders`: which samples each rank reads.
- :mod:`~multigpu.runtime.collective_failures`: a broken collective re-raised with its likely cause.
- :mod:`~multigpu.runtime.failure_records`: each worker's first failure, for the launcher's summary.

Nothing here starts processes: that is :mod:`multigpu.launcher`, the parent side.
"""

from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.collectives import barrier, gather_by_index, reduce_value
from multigpu.runtime.data import EpochLoader, ShardSpec, build_epoch_loader, even_batches
from multigpu.runtime.world import (
    LaunchEnv,
    LaunchError,
    is_main_process,
    read_launch_env,
    setup_process_group,
    teardown_process_group,
)

__all__ = [
    "EpochLoader",
    "LaunchEnv",
    "LaunchError",
    "ShardSpec",
    "barrier",
    "build_epoch_loader",
    "even_batches",
    "explain_collective_failures",
    "gather_by_index",
    "is_main_process",
    "read_launch_env",
    "reduce_value",
    "setup_process_group",
    "teardown_process_group",
]
