"""The world a scheduler's variables describe, and the two readers every scheduler's variables share.

:mod:`multigpu.runtime.schedulers` (SLURM, a PyTorchJob pod, the dispatch) and
:mod:`multigpu.runtime.mpi_env` (Open MPI, MPICH) build a :class:`SchedulerWorld`; a count or a port
that does not parse is refused by name.

Example:
    >>> read_ints({"SLURM_PROCID": "3"}, ["SLURM_PROCID"], "start it with srun")
    [3]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from multigpu.errors import LaunchError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class SchedulerWorld:
    """The world a scheduler's variables describe, for one process (or, for the launcher, one node).

    Attributes:
        scheduler: ``slurm``, ``openmpi``, ``mpich`` or ``torchrun``.
        global_rank: this process's rank among all.
        local_rank: its rank on its node.
        world_size: processes in the run.
        local_world_size: processes on this node.
        node_rank: this node's rank; None when the variables do not say it (MPI on several nodes).
        master_addr: where rank 0's store listens.
        master_port: its port.
    """

    scheduler: str
    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int | None
    master_addr: str
    master_port: int


def read_ints(env: Mapping[str, str], names: list[str], fix: str) -> list[int]:
    """The variables ``names`` as counts or indexes; a LaunchError naming the first that is not one and ``fix``."""
    values = []
    for name in names:
        value = env.get(name, "")
        if not value.strip().isdigit():
            raise LaunchError(f"{name}={value!r} is not a count or index; {fix}")
        values.append(int(value))
    return values


def read_port(env: Mapping[str, str]) -> int:
    """``MASTER_PORT`` (29500 when unset); a LaunchError when it is not a TCP port."""
    value = env.get("MASTER_PORT", str(DEFAULT_PORT))
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise LaunchError(f"MASTER_PORT={value!r} is not a TCP port; set it to one in 1..65535 on every process")
    return int(value)
