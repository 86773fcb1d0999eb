"""Which MPI started this process, and the world (or, for ``multigpu launch``, the nodes) its variables imply.

- **Open MPI**: ``OMPI_COMM_WORLD_RANK``/``_SIZE``, and on this node ``OMPI_COMM_WORLD_LOCAL_RANK``/``_SIZE``.
- **MPICH / Intel MPI / Cray** (:data:`MPICH`): ``PMI_RANK``/``PMI_SIZE``, and on this node
  ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS`` (Hydra, Intel MPI) or ``PMI_LOCAL_RANK``/``PMI_LOCAL_SIZE`` (Cray).

The local rank (the GPU a process takes) comes only from the variables that mean it; without them
every rank is taken to run on this node, and a ``MASTER_ADDR`` of another host is refused. MPI names
no node index (``OMPI_COMM_WORLD_NODE_RANK`` is a local rank counted across jobs, and ``rank // local
size`` is wrong under ``--map-by node``), so the node rank stays unknown on several nodes.
:mod:`multigpu.runtime.schedulers` decides when MPI's variables are the ones to read.

Example:
    >>> mpi_worker({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, OPEN_MPI).local_rank
    1
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from multigpu.errors import LaunchError
from multigpu.runtime.scheduler_world import SchedulerWorld, read_addr, read_ints, read_port


@dataclass(frozen=True)
class Mpi:
    """One MPI's variable names: rank and size, and the pairs that mean the rank and size on this node."""

    name: str
    rank_var: str
    size_var: str
    local_vars: tuple[tuple[str, str], ...]
    one_per_node: str  # how this MPI starts one process per node


OPEN_MPI = Mpi(
    "openmpi",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),),
    "mpirun --map-by ppr:1:node",
)
# MPICH's Hydra and Intel MPI set MPI_LOCALRANKID/MPI_LOCALNRANKS; Cray's PMI sets PMI_LOCAL_RANK/_SIZE
MPICH = Mpi(
    "mpich",
    "PMI_RANK",
    "PMI_SIZE",
    (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")),
    "mpiexec -ppn 1 (Open MPI: mpirun --map-by ppr:1:node)",
)
_MPI_FIX = "start the processes with mpirun (e.g. 'mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT python train.py')"
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def mpi_flavour(env: Mapping[str, str]) -> Mpi | None:
    """The MPI whose rank and size variables are set, if one's are."""
    if "OMPI_COMM_WORLD_RANK" in env:
        return OPEN_MPI
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return MPICH
    return None


def mpi_local(env: Mapping[str, str], mpi: Mpi, world: int) -> tuple[str, str, int, int] | None:
    """``(local rank variable, local size variable, local rank, local size)`` when the MPI set them.

    Raises:
        LaunchError: a local rank outside the local size, or a local size above ``world``.
    """
    for rank_var, size_var in mpi.local_vars:
        if rank_var in env:
            local_rank, local_world = read_ints(env, [rank_var, size_var], _MPI_FIX)
            if not 0 <= local_rank < local_world <= world:
                raise LaunchError(
                    f"{rank_var}={local_rank} and {size_var}={local_world} do not fit {mpi.size_var}={world}; "
                    f"{_MPI_FIX}"
                )
            return rank_var, size_var, local_rank, local_world
    return None


def _local_names(mpi: Mpi) -> str:
    return " or ".join(f"{rank_var} and {size_var}" for rank_var, size_var in mpi.local_vars)


def _is_loopback(addr: str) -> bool:
    return addr.strip("[]").lower() in _LOOPBACK or addr.startswith("127.")


def mpi_worker(env: Mapping[str, str], mpi: Mpi) -> SchedulerWorld:
    """The world ``mpi``'s variables describe for this process.

    Raises:
        LaunchError: a rank outside the world, local variables that do not fit it, several nodes
            without ``MASTER_ADDR``, or no local variables with a ``MASTER_ADDR`` of another host.
    """
    rank, world = read_ints(env, [mpi.rank_var, mpi.size_var], _MPI_FIX)
    if not 0 <= rank < world:
        raise LaunchError(f"{mpi.rank_var}={rank} lies outside {mpi.size_var}={world} processes; {_MPI_FIX}")
    local = mpi_local(env, mpi, world)
    addr = read_addr(env)
    if local is None:
        if addr and not _is_loopback(addr):
            raise LaunchError(
                f"{mpi.name} started {mpi.size_var}={world} processes with MASTER_ADDR={addr!r}, another host, but "
                f"without {_local_names(mpi)}: which rank runs where (the GPU each takes) is unknown; start them "
                "with an mpirun that sets these (Open MPI, MPICH's Hydra, Intel MPI), or set MASTER_ADDR=127.0.0.1 "
                "when every rank runs on this node"
            )
        local = ("", "", rank, world)  # every rank on this node (the master is here)
    local_rank_var, local_size_var, local_rank, local_world = local
    if not 0 <= local_rank < local_world <= world:
        raise LaunchError(
            f"{local_rank_var}={local_rank} and {local_size_var}={local_world} do not fit {mpi.size_var}={world}; "
            f"{_MPI_FIX}"
        )
    if addr is None and local_world < world:
        raise LaunchError(
            f"{mpi.name} started {world} processes on several nodes ({local_size_var}={local_world}) but MASTER_ADDR "
            "is not set: export MASTER_ADDR (rank 0's host) and MASTER_PORT and pass them with mpirun -x"
        )
    return SchedulerWorld(
        scheduler=mpi.name,
        global_rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        # MPI says no node index (OMPI_COMM_WORLD_NODE_RANK is a local rank, and rank // local size is
        # wrong under --map-by node): unknown, unless every rank runs on this one node
        node_rank=0 if local_world == world else None,
        master_addr=addr or "127.0.0.1",
        master_port=read_port(env),
    )


def mpi_launcher(env: Mapping[str, str], mpi: Mpi) -> dict[str, str]:
    """``multigpu launch`` under mpirun: one launcher per node, MPI's size and rank as the nodes and node rank."""
    rank, world = read_ints(env, [mpi.rank_var, mpi.size_var], _MPI_FIX)
    if not 0 <= rank < world:
        raise LaunchError(f"{mpi.rank_var}={rank} lies outside {mpi.size_var}={world} launchers; {_MPI_FIX}")
    if world == 1:
        return {"nnodes": "1", "node-rank": "0"}
    local = mpi_local(env, mpi, world)
    if local is None or local[3] != 1:
        said = f"{local[1]}={local[3]}" if local else f"without {_local_names(mpi)}"
        raise LaunchError(
            f"multigpu launch runs once per node and starts the processes itself, but {mpi.name} started "
            f"{mpi.size_var}={world} launchers ({said}); start one per node: '{mpi.one_per_node} -np <nodes> "
            "-x MASTER_ADDR -x MASTER_PORT multigpu launch ...'"
        )
    addr = read_addr(env)
    if addr is None:
        raise LaunchError(
            f"multigpu launch under {mpi.name} on {world} nodes needs rank 0's host, but MASTER_ADDR is not set: "
            "export MASTER_ADDR and MASTER_PORT and pass them with mpirun -x MASTER_ADDR -x MASTER_PORT"
        )
    return {
        "nnodes": str(world),
        "node-rank": str(rank),
        "master-addr": addr,
        "master-port": str(read_port(env)),
    }
