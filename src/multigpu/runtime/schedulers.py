"""Which scheduler started this process, and the world its variables imply: one priority tuple of schedulers.

:data:`SCHEDULERS` lists every way a cluster starts processes, first match first. Each is an object
whose answers are pure functions of an environment mapping (the caller passes ``os.environ``):

- :meth:`Scheduler.detects`: am I the one that started this worker;
- :meth:`Scheduler.worker`: the worker's world (:class:`SchedulerWorld`), or a :class:`~multigpu.errors.LaunchError`
  naming the variables that contradict each other and the fix;
- :meth:`Scheduler.launcher`: what ``multigpu launch`` on this node should use, by long flag name (None:
  not here);
- :meth:`Scheduler.refusal`: why a process that this scheduler's variables surround is no worker of it
  (``python train.py`` inside an ``salloc``), or None.

:func:`detect_worker` (asked by :mod:`multigpu.runtime.world`), :func:`launcher_defaults` and
:func:`not_started_reason` walk the one tuple, so the precedence is written once:

1. **torchrun** (also ``multigpu launch``): ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; for the launcher,
   torchrun's ``PET_*`` (what Kubeflow's PyTorchJob sets; :mod:`multigpu.runtime.pet_env`).
2. **A PyTorchJob pod** whose container runs the script itself: ``RANK``/``WORLD_SIZE`` without
   ``LOCAL_RANK`` (:func:`pytorchjob_pod`): local rank 0 of 1; for the launcher of an operator older than
   ``PET_*``, the pods are the nodes.
3. **Open MPI**, **MPICH / Intel MPI / Cray** (:mod:`multigpu.runtime.mpi_env`), with ``MASTER_ADDR``
   and ``MASTER_PORT`` (loopback and :data:`DEFAULT_PORT` when every rank runs on this node). MPI's
   variables win over SLURM's (mpirun inside an sbatch job starts its daemons with srun), but for ``srun
   --mpi=pmi2``, whose ``PMI_RANK`` is the task's ``SLURM_PROCID``.
4. **SLURM** (a task of an ``srun`` step; :mod:`multigpu.runtime.slurm_env`): rank ``SLURM_PROCID``, the
   step's (else the job's) tasks, tasks per node and hosts, which must agree; the master is the first
   host, the port one every task of the step derives alike. The batch, extern and interactive steps
   (python run directly in the batch script) are no srun step.

A variable that does not parse (a count that is not ASCII digits or is above torch's C int, a port
outside 1..65535, a host with spaces) is refused by name, showing its value cut short, at once: no
world is waited for that cannot form.

Example:
    >>> detect_worker({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}).global_rank
    1
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar

from multigpu.errors import LaunchError
from multigpu.runtime.mpi_env import MPICH, OPEN_MPI, Mpi, mpi_flavour, mpi_launcher, mpi_worker
from multigpu.runtime.pet_env import pet_launcher
from multigpu.runtime.scheduler_world import DEFAULT_PORT, SchedulerWorld, read_addr, read_ints, read_port, shown
from multigpu.runtime.slurm_env import (
    in_srun_step,
    slurm_job_id,
    slurm_launcher,
    slurm_port,
    slurm_worker,
)
from multigpu.runtime.slurm_env import (
    not_started_reason as slurm_not_started_reason,
)
from multigpu.runtime.slurm_lists import expand_hostlist, expand_tasks_per_node

__all__ = [
    "DEFAULT_PORT",
    "PYTORCHJOB",
    "SCHEDULERS",
    "TORCHRUN",
    "Scheduler",
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
PYTORCHJOB = "pytorchjob"  # the scheduler name of a PyTorchJob pod whose container runs the script directly


class Scheduler:
    """One way a cluster starts processes; every answer is a pure function of the environment mapping.

    Subclasses answer :meth:`detects` and :meth:`worker`, and :meth:`launcher` / :meth:`refusal` where
    they have something to say. ``name`` is the scheduler's name in ``LaunchEnv.scheduler`` and
    ``multigpu env``.
    """

    name: ClassVar[str]
    # Whether its variables still describe the one process ``multigpu launch --strategy single|dp`` starts:
    # torch's (set for this very process) do; MPI's and SLURM's, inherited from the launcher, were its task's.
    describes_a_launched_process: ClassVar[bool] = False

    def detects(self, env: Mapping[str, str]) -> bool:
        """Whether this scheduler started the worker process whose variables ``env`` are."""
        raise NotImplementedError

    def worker(self, env: Mapping[str, str]) -> SchedulerWorld:
        """The world ``env`` describes for one worker (asked where :meth:`detects`).

        Raises:
            LaunchError: the variables contradict each other or do not parse (the message names them and the fix).
        """
        raise NotImplementedError

    def launcher(self, env: Mapping[str, str]) -> dict[str, str] | None:
        """What ``multigpu launch`` on this node should use, by long flag name; None where it is not here."""
        return None

    def refusal(self, env: Mapping[str, str]) -> str | None:
        """Why a process ``env`` places inside this scheduler's job is no worker of it, or None."""
        return None

    def __repr__(self) -> str:
        return f"<scheduler {self.name}>"


class Torchrun(Scheduler):
    """torchrun and ``multigpu launch``: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``; ``PET_*``."""

    name = TORCHRUN
    describes_a_launched_process = True

    def detects(self, env: Mapping[str, str]) -> bool:
        return "RANK" in env and "WORLD_SIZE" in env and not PyTorchJobPod.here(env)

    def worker(self, env: Mapping[str, str]) -> SchedulerWorld:
        return torchrun_worker(env)

    def launcher(self, env: Mapping[str, str]) -> dict[str, str] | None:
        return pet_launcher(env) or None


class PyTorchJobPod(Scheduler):
    """A PyTorchJob pod whose container runs the script itself: ``RANK``/``WORLD_SIZE`` without ``LOCAL_RANK``."""

    name = PYTORCHJOB
    describes_a_launched_process = True

    @staticmethod
    def here(env: Mapping[str, str]) -> bool:
        """Kubeflow's training operator sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` on
        every pod (and, newer ones, ``PET_NNODES``/``PET_NODE_RANK``/``PET_NPROC_PER_NODE``); torchrun would
        add ``LOCAL_RANK``."""
        if "LOCAL_RANK" in env or "RANK" not in env or "MASTER_ADDR" not in env:
            return False
        return any(
            name in env for name in ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "KUBERNETES_SERVICE_HOST")
        )

    def detects(self, env: Mapping[str, str]) -> bool:
        return "WORLD_SIZE" in env and self.here(env)

    def worker(self, env: Mapping[str, str]) -> SchedulerWorld:
        return torchrun_worker(env)

    def launcher(self, env: Mapping[str, str]) -> dict[str, str] | None:
        # an operator older than PET_* (a newer one's PET_* are torchrun's, asked first): RANK is the pod's index
        return _pod_launcher(env) if "WORLD_SIZE" in env and pytorchjob_pod(env) else None


class MpiScheduler(Scheduler):
    """One MPI (:mod:`multigpu.runtime.mpi_env`): its rank and size variables, and this node's."""

    def __init__(self, mpi: Mpi) -> None:
        self.mpi = mpi

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.mpi.name

    def detects(self, env: Mapping[str, str]) -> bool:
        # not srun --mpi=pmi2's tasks: SLURM's PMI gives each its own SLURM_PROCID as PMI_RANK
        return mpi_flavour(env) is self.mpi and not _srun_started_pmi(env, self.mpi)

    def worker(self, env: Mapping[str, str]) -> SchedulerWorld:
        return mpi_worker(env, self.mpi)

    def launcher(self, env: Mapping[str, str]) -> dict[str, str] | None:
        return mpi_launcher(env, self.mpi) if self.detects(env) else None


class Slurm(Scheduler):
    """A task of an ``srun`` step (:mod:`multigpu.runtime.slurm_env`)."""

    name = "slurm"

    def detects(self, env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env and in_srun_step(env)

    def worker(self, env: Mapping[str, str]) -> SchedulerWorld:
        return slurm_worker(env)

    def launcher(self, env: Mapping[str, str]) -> dict[str, str] | None:
        return slurm_launcher(env) if self.detects(env) else None

    def refusal(self, env: Mapping[str, str]) -> str | None:
        return slurm_not_started_reason(env)


# The one precedence, first match first. torch's variables first: torchrun sets them for its own workers,
# which also inherit the MPI or SLURM variables of the launcher mpirun or srun started. MPI's before
# SLURM's: mpirun inside an sbatch job starts its daemons with srun, so the SLURM variables its ranks
# inherit describe the daemons (one per node), not the ranks.
SCHEDULERS: tuple[Scheduler, ...] = (Torchrun(), PyTorchJobPod(), MpiScheduler(OPEN_MPI), MpiScheduler(MPICH), Slurm())


def detect_worker(env: Mapping[str, str], *, launched_alone: bool = False) -> SchedulerWorld | None:
    """The world a scheduler started this worker into, or None when none did.

    Args:
        env: the process's environment.
        launched_alone: the process is the one ``multigpu launch --strategy single|dp`` started: only
            schedulers whose variables describe such a process count (``describes_a_launched_process``).

    Raises:
        LaunchError: the variables contradict each other (the message names them and the fix).
    """
    for scheduler in SCHEDULERS:
        if (scheduler.describes_a_launched_process or not launched_alone) and scheduler.detects(env):
            return scheduler.worker(env)
    if not launched_alone:  # the one process multigpu launch started: its launcher made it one, whatever it inherited
        _refuse_half_a_torch_world(env)
    return None


def _refuse_half_a_torch_world(env: Mapping[str, str]) -> None:
    """``RANK`` without ``WORLD_SIZE`` (or the reverse) that says this process is one of several, where no
    scheduler's variables say the rest: run alone, every such process would be the main one (writing the
    same checkpoints and logs), so it is refused by name. ``RANK=0`` or ``WORLD_SIZE=1`` alone says nothing."""
    for name, other, alone in (("RANK", "WORLD_SIZE", "0"), ("WORLD_SIZE", "RANK", "1")):
        value = env.get(name)
        if value and not env.get(other) and value.lstrip("0") != alone.lstrip("0"):
            raise LaunchError(
                f"{shown(name, value)} is set but {other} is not: this process would run alone, as the main "
                f"process, beside the others it names; set {other} as well (a launcher sets both on every "
                f"process: 'multigpu launch --strategy ddp --nproc-per-node 2 script.py' or torchrun), or unset {name}"
            )


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
    for scheduler in SCHEDULERS:
        values = scheduler.launcher(env)
        if values is not None:
            return scheduler.name, values
    return None, {}


def not_started_reason(env: Mapping[str, str]) -> str | None:
    """Why this process is no worker of the job its variables place it in (SLURM's batch step), or None."""
    return next((reason for s in SCHEDULERS if (reason := s.refusal(env)) is not None), None)


def pytorchjob_pod(env: Mapping[str, str]) -> bool:
    """Whether ``RANK``/``WORLD_SIZE`` without ``LOCAL_RANK`` are a PyTorchJob pod's: one process per pod.

    A container that runs ``python train.py`` itself is local rank 0 of 1.

    Raises:
        LaunchError: ``PET_NPROC_PER_NODE`` asks for several processes per pod, which only a launcher in
            the pod starts.
    """
    if not PyTorchJobPod.here(env):
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
        if local_world < world and "MASTER_ADDR" not in env:  # torch's env:// has no default host
            raise LaunchError(
                f"WORLD_SIZE={world} processes with LOCAL_WORLD_SIZE={local_world} on this node run on several "
                "nodes, but MASTER_ADDR is not set: the ranks of other nodes would wait for rank 0 on their own "
                "loopback; set MASTER_ADDR (rank 0's host) and MASTER_PORT alike on every process (torchrun and "
                "multigpu launch do)"
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
