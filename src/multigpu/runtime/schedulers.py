"""Which scheduler started this process, and the world its variables imply (SLURM, MPI, torchrun's ``PET_*``).

:mod:`multigpu.runtime.world` reads torchrun's ``RANK``/``WORLD_SIZE`` first; a process without
them asks :func:`detect_worker` here, so ``srun python train.py`` and ``mpirun -np 2 python
train.py`` form the same world as ``multigpu launch``:

- **SLURM** (a task of an ``srun`` step; :mod:`multigpu.runtime.slurm_env`): rank ``SLURM_PROCID``, the
  step's (else the job's) tasks, tasks per node and hosts, which must agree; the master is the first host,
  the port one every task of the step derives alike. The batch, extern and interactive steps (python run
  directly in the batch script) are no srun step.
- **A PyTorchJob pod** whose container runs the script itself: ``RANK``/``WORLD_SIZE`` without
  ``LOCAL_RANK`` (:func:`pytorchjob_pod`): local rank 0 of 1.
- **Open MPI**, **MPICH / Intel MPI / Cray** (:mod:`multigpu.runtime.mpi_env`), with ``MASTER_ADDR``
  and ``MASTER_PORT`` (loopback and :data:`DEFAULT_PORT` when every rank runs on this node). MPI's variables win
  over SLURM's (mpirun inside an sbatch job starts its daemons with srun), but for ``srun
  --mpi=pmi2``, whose ``PMI_RANK`` is the task's ``SLURM_PROCID``.

The parent side (``multigpu launch``) asks :func:`launcher_defaults`: torchrun's ``PET_*`` variables
(what Kubeflow's PyTorchJob sets; :mod:`multigpu.runtime.pet_env`), under mpirun (one launcher per
node) MPI's size and rank, and, inside a SLURM step, the nodes and this node's rank.
Inconsistent variables raise a :class:`~multigpu.errors.LaunchError` naming them and the fix; so does a
variable that does not parse (a count that is not ASCII digits or is above torch's C int, a port outside
1..65535, a host with spaces), showing its value cut short, at once: no world is waited for that cannot form.

Example:
    >>> detect_worker({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}).global_rank
    1
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from multigpu.errors import LaunchError
from multigpu.runtime.mpi_env import MPICH, Mpi, mpi_flavour, mpi_launcher, mpi_worker
from multigpu.runtime.pet_env import pet_launcher
from multigpu.runtime.scheduler_world import DEFAULT_PORT, SchedulerWorld, read_addr, read_ints, read_port, shown
from multigpu.runtime.slurm_env import (
    in_srun_step,
    not_started_reason,
    slurm_job_id,
    slurm_launcher,
    slurm_port,
    slurm_worker,
)
from multigpu.runtime.slurm_lists import expand_hostlist, expand_tasks_per_node

__all__ = [
    "DEFAULT_PORT",
    "PYTORCHJOB",
    "TORCHRUN",
    "SchedulerWorld",
    "detect_worker",
    "expand_hostlist",
    "expand_tasks_per_node",
    "launcher_defaults",
    "not_started_reason",
    "pytorchjob_pod",
    "slurm_job_id",
    "slurm_port",
    "torchrun_worker",
]

TORCHRUN = "torchrun"  # the scheduler name of RANK/WORLD_SIZE (torchrun, multigpu launch) and of PET_*


def detect_worker(env: Mapping[str, str]) -> SchedulerWorld | None:
    """The world a scheduler started this worker into, or None when none did.

    Args:
        env: the process's environment (``RANK``/``WORLD_SIZE`` are read before this, by the caller).

    Raises:
        LaunchError: the variables contradict each other (the message names them and the fix).
    """
    # MPI's variables before SLURM's: mpirun inside an sbatch job starts its daemons with srun, so the
    # SLURM variables its ranks inherit describe the daemons (one per node), not the ranks
    mpi = mpi_flavour(env)
    if mpi is not None and not _srun_started_pmi(env, mpi):
        return mpi_worker(env, mpi)
    if "SLURM_PROCID" in env and in_srun_step(env):
        return slurm_worker(env)
    return None


PYTORCHJOB = "pytorchjob"  # the scheduler name of a PyTorchJob pod whose container runs the script directly


def pytorchjob_pod(env: Mapping[str, str]) -> bool:
    """Whether ``RANK``/``WORLD_SIZE`` without ``LOCAL_RANK`` are a PyTorchJob pod's: one process per pod.

    Kubeflow's training operator sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` on
    every pod (and, newer ones, ``PET_NNODES``/``PET_NODE_RANK``/``PET_NPROC_PER_NODE``); torchrun would
    add ``LOCAL_RANK``. A container that runs ``python train.py`` itself is local rank 0 of 1.

    Raises:
        LaunchError: ``PET_NPROC_PER_NODE`` asks for several processes per pod, which only a launcher in
            the pod starts.
    """
    if "LOCAL_RANK" in env or "RANK" not in env or "MASTER_ADDR" not in env:
        return False
    if not any(
        name in env for name in ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "KUBERNETES_SERVICE_HOST")
    ):
        return False
    nproc = env.get("PET_NPROC_PER_NODE", "1")
    if nproc != "1":
        raise LaunchError(
            f"this PyTorchJob pod expects {shown('PET_NPROC_PER_NODE', nproc)} processes (nprocPerNode), but this one was "
            "started directly, without LOCAL_RANK: make the container's command 'multigpu launch --strategy ddp "
            "train.py' (it starts them, as torchrun would), or set nprocPerNode: 1"
        )
    return True


_LAUNCH_FIX = (
    "start the script with a launcher, e.g. 'multigpu launch --strategy ddp --nproc-per-node 2 script.py' "
    "(or torchrun), which sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE alike on every process"
)


def torchrun_worker(env: Mapping[str, str]) -> SchedulerWorld:
    """The world torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` describe (a
    PyTorchJob pod's, local rank 0 of 1, when :func:`pytorchjob_pod`), with ``MASTER_ADDR``/``MASTER_PORT``.

    Raises:
        LaunchError: a variable that is not a count, a rank outside the world, a local rank outside the
            node's processes or more of them than the world, a pod whose ``RANK``/``WORLD_SIZE`` contradict
            its ``PET_NODE_RANK``/``PET_NNODES``, or a master address or port that is not one.
    """
    pod = pytorchjob_pod(env)  # one process per PyTorchJob pod, started without torchrun
    rank, world = read_ints(env, ["RANK", "WORLD_SIZE"], _LAUNCH_FIX)
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} must lie in [0, WORLD_SIZE={world}); {_LAUNCH_FIX}")
    if pod:
        _check_pod_against_pet(env, rank, world)
        local_rank, local_world = 0, 1
    else:
        local_rank, local_world = (
            read_ints(env, [name], _LAUNCH_FIX)[0] if name in env else default
            for name, default in (("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", world))
        )
        if not 0 <= local_rank < local_world <= world:
            raise LaunchError(
                f"LOCAL_RANK={local_rank} and LOCAL_WORLD_SIZE={local_world} do not fit WORLD_SIZE={world} "
                f"(0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE); {_LAUNCH_FIX}"
            )
    return SchedulerWorld(
        scheduler=PYTORCHJOB if pod else TORCHRUN,
        global_rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=rank if pod else None,
        master_addr=read_addr(env) or "127.0.0.1",
        master_port=read_port(env),
    )


def _check_pod_against_pet(env: Mapping[str, str], rank: int, world: int) -> None:
    """A pod of one process: its ``RANK``/``WORLD_SIZE`` are its ``PET_NODE_RANK``/``PET_NNODES`` (where a
    plain count; ``1:4`` is elastic), or the pods would wait for a world that cannot form."""
    for name, value in (("PET_NODE_RANK", rank), ("PET_NNODES", world)):
        said = env.get(name, "")
        if re.fullmatch(r"[0-9]{1,10}", said) and int(said) != value:
            other = "RANK" if name == "PET_NODE_RANK" else "WORLD_SIZE"
            raise LaunchError(
                f"this PyTorchJob pod runs one process, so {other}={value} must equal {name}={said}; fix the "
                "PyTorchJob's spec (or unset the variable set by hand)"
            )


def _srun_started_pmi(env: Mapping[str, str], mpi: Mpi) -> bool:
    """``srun --mpi=pmi2 python train.py``: SLURM's PMI gives each task its own SLURM_PROCID as PMI_RANK,
    and only SLURM's variables say the local rank; then SLURM's world is the one."""
    if mpi is not MPICH or any(rank_var in env for rank_var, _ in mpi.local_vars):
        return False
    return "SLURM_PROCID" in env and in_srun_step(env) and env.get("SLURM_PROCID") == env.get("PMI_RANK")


# -- the launcher's side ---------------------------------------------------------------------------


def launcher_defaults(env: Mapping[str, str]) -> tuple[str | None, dict[str, str]]:
    """What the scheduler says ``multigpu launch`` on this node should use, by long flag name.

    Returns:
        ``(scheduler, values)``: ``("torchrun", ...)`` from ``PET_*``; ``("pytorchjob", ...)`` from a
        pod of an operator older than ``PET_*`` (``RANK``/``WORLD_SIZE`` as node rank and nodes);
        ``("openmpi", ...)`` or ``("mpich", ...)`` from one launcher per node started by mpirun (MPI's
        size and rank as the nodes and node rank); ``("slurm", ...)`` from a task of an srun step
        (nodes, node rank, master address and port); or ``(None, {})``. Flags given on the command
        line or in a config file win over these.

    Raises:
        LaunchError: an srun step or an mpirun that starts more than one launcher per node, or
            mpirun on several nodes without ``MASTER_ADDR``.
    """
    pet = pet_launcher(env)
    if pet:
        return TORCHRUN, pet
    mpi = mpi_flavour(env)
    if mpi is not None and not _srun_started_pmi(env, mpi):  # MPI's before SLURM's, as for the workers
        return mpi.name, mpi_launcher(env, mpi)
    if "WORLD_SIZE" in env and pytorchjob_pod(env):  # an operator older than PET_*: RANK is the pod's index
        return PYTORCHJOB, _pod_launcher(env)
    if "SLURM_PROCID" not in env or not in_srun_step(env):
        return None, {}
    return "slurm", slurm_launcher(env)


def _pod_launcher(env: Mapping[str, str]) -> dict[str, str]:
    """``multigpu launch`` in a pod of an operator that sets no ``PET_*``: the pods are the nodes."""
    fix = "a PyTorchJob's operator sets RANK (the pod's index) and WORLD_SIZE (the pods); set --nnodes/--node-rank"
    rank, pods = read_ints(env, ["RANK", "WORLD_SIZE"], fix)
    if not 0 <= rank < pods:
        raise LaunchError(f"RANK={rank} lies outside WORLD_SIZE={pods} pods; {fix}")
    if pods == 1:
        return {"nnodes": "1", "node-rank": "0"}
    return {
        "nnodes": str(pods),
        "node-rank": str(rank),
        "master-addr": read_addr(env) or "",  # pytorchjob_pod checked MASTER_ADDR is set
        "master-port": str(read_port(env)),
    }
