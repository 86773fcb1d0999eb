"""Which scheduler started this process, and the world its variables imply (SLURM, MPI, torchrun's ``PET_*``).

:mod:`multigpu.runtime.world` reads torchrun's ``RANK``/``WORLD_SIZE`` first; a process without
them asks :func:`detect_worker` here, so ``srun python train.py`` and ``mpirun -np 2 python
train.py`` form the same world as ``multigpu launch``:

- **SLURM** (a task of an ``srun`` step): rank ``SLURM_PROCID``, local rank ``SLURM_LOCALID``, node
  ``SLURM_NODEID``; the world, tasks per node and hosts from the step's variables
  (``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NUM_NODES``, ``SLURM_STEP_TASKS_PER_NODE``,
  ``SLURM_STEP_NODELIST``) when srun set them, else from the job's (``SLURM_NTASKS``, ``SLURM_NNODES``,
  ``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_NODELIST``), never a mix: a step may be smaller than its job.
  Compressed lists are read by :mod:`multigpu.runtime.slurm_lists` (never expanded: the count and the
  first host are computed), and the node count, the hosts and the tasks per node must agree. The master is the first host;
  the port is ``MASTER_PORT``, else derived from ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``
  (:func:`slurm_port`) so every task computes the same one and two steps of one job differ. The
  batch, extern and interactive steps (python run directly in the batch script) are no srun step.
- **A PyTorchJob pod** whose container runs the script itself: ``RANK``/``WORLD_SIZE`` without
  ``LOCAL_RANK`` (:func:`pytorchjob_pod`): local rank 0 of 1.
- **Open MPI**, **MPICH / Intel MPI / Cray** (:mod:`multigpu.runtime.mpi_env`), with ``MASTER_ADDR``
  and ``MASTER_PORT`` (loopback and 29500 when every rank runs on this node). MPI's variables win
  over SLURM's (mpirun inside an sbatch job starts its daemons with srun), but for ``srun
  --mpi=pmi2``, whose ``PMI_RANK`` is the task's ``SLURM_PROCID``.

The parent side (``multigpu launch``) asks :func:`launcher_defaults`: torchrun's ``PET_*`` variables
(what Kubeflow's PyTorchJob sets; :mod:`multigpu.runtime.pet_env`), under mpirun (one launcher per node) MPI's size and rank, and,
inside a SLURM step, the nodes and this node's rank.
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
from dataclasses import dataclass

from multigpu.errors import LaunchError
from multigpu.runtime.mpi_env import MPICH, Mpi, mpi_flavour, mpi_launcher, mpi_worker
from multigpu.runtime.pet_env import pet_launcher
from multigpu.runtime.scheduler_world import (
    DEFAULT_PORT,
    SchedulerWorld,
    parse_count,
    read_addr,
    read_ints,
    read_port,
    shown,
)
from multigpu.runtime.slurm_lists import Hostlist, TasksPerNode, expand_hostlist, expand_tasks_per_node

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
_PORT_BASE, _PORT_SPAN = 20000, 20000  # job-derived ports: 20000..39999, below Linux's ephemeral range
_PORT_STEP = 1000  # apart per step of one job
# SLURM's step ids above SLURM_MAX_NORMAL_STEP_ID (0xfffffff0) name no srun step: the batch script
# (0xfffffffb; 0xfffffffe before 20.11), the extern container (0xfffffffc; 0xffffffff before), the
# interactive step (0xfffffffa); environments spell some of them as words
_MAX_NORMAL_STEP_ID = 0xFFFFFFF0
_SPECIAL_STEPS = {"batch", "extern", "interactive", "pending", "tbd"}
_SLURM_FIX = "start one task per process with srun (e.g. 'srun --ntasks-per-node=2 python train.py')"


def slurm_port(job_id: str, step_id: str = "0") -> int:
    """The port every task of step ``step_id`` of SLURM job ``job_id`` derives alike (when ``MASTER_PORT`` is not set).

    ``20000 + (job + 1000 * step) % 20000``: the steps of one job that run at the same time (up to 20) get
    different ports; step 0 keeps the job's own.

    Example:
        >>> slurm_port("123456")
        23456
        >>> slurm_port("123456", "1")
        24456
    """
    # array jobs: '123_4'; only the last 9 digits count (10**9 is a multiple of the span), so a job id of
    # any length (and only ASCII digits: int() would take other scripts' too) derives a port alike
    job = int(re.sub(r"[^0-9]", "", job_id)[-9:] or "0")
    step = int(step_id[-9:]) if re.fullmatch(r"[0-9]+", step_id) else 0
    return _PORT_BASE + (job + _PORT_STEP * step) % _PORT_SPAN


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
    if "SLURM_PROCID" in env and _in_srun_step(env):
        return _slurm_worker(env)
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
    return "SLURM_PROCID" in env and _in_srun_step(env) and env.get("SLURM_PROCID") == env.get("PMI_RANK")


def not_started_reason(env: Mapping[str, str]) -> str | None:
    """Why a process inside a SLURM allocation that expects several tasks is not one of them, if it is so.

    ``python train.py`` typed in an ``salloc`` shell, or run by an ``sbatch`` script without
    ``srun`` (the batch step, ``SLURM_STEP_ID=batch``), sees ``SLURM_NTASKS`` > 1 but is no task of a
    step: it would wait forever for the others, so the world's caller refuses it with this reason.
    """
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or ""
    several = re.fullmatch(r"0*([2-9]|[1-9][0-9]+)", tasks) is not None  # without int(): it may be 5000 digits
    if "SLURM_JOB_ID" not in env or _in_srun_step(env) or not several:
        return None
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    how = f"it runs in SLURM_STEP_ID={step}, not an srun step" if step else "no SLURM_STEP_ID"
    return (
        f"this process runs inside SLURM job {env['SLURM_JOB_ID'][:40]}, which expects SLURM_NTASKS={tasks if len(tasks) <= 20 else tasks[:20] + '...'} tasks, "
        f"but it was not started by srun ({how}); {_SLURM_FIX}"
    )


def _in_srun_step(env: Mapping[str, str]) -> bool:
    # srun sets the step id for its tasks; an sbatch script's own shell (the batch step) has
    # SLURM_PROCID=0 and the allocation's SLURM_NTASKS but is not one of the tasks, and its step id,
    # where set, is one of SLURM's special ones
    step = (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "").strip()
    if not step or step.lower() in _SPECIAL_STEPS:
        return False
    if re.fullmatch(r"[0-9]+", step) is None:
        return True
    digits = step.lstrip("0")
    return len(digits) < 10 and int(digits or "0") < _MAX_NORMAL_STEP_ID  # not int() of thousands of digits


@dataclass(frozen=True)
class _SlurmCounts:
    """One consistent set of SLURM's counts: the step's (``SLURM_STEP_*``) or the job's, never a mix.

    ``nodes`` is the one node count ``nodes_var``, ``per_node_var`` and ``nodelist_var`` agree on (each
    where set); ``per_node`` None means every task on one node; ``hosts`` None means no host list.
    """

    tasks_var: str
    tasks: int
    nodes_var: str
    nodes: int
    per_node_var: str
    per_node: TasksPerNode | None
    nodelist_var: str
    hosts: Hostlist | None

    def on_node(self, node: int) -> int:
        return self.per_node.on_node(node) if self.per_node is not None else self.tasks


_SLURM_COUNTS_FIX = (
    "request consistent counts (e.g. --nodes=2 --ntasks-per-node=2, no --ntasks); were some set by hand?"
)


def _slurm_counts(env: Mapping[str, str]) -> _SlurmCounts:
    """The step's counts when srun set them (a step may be smaller than its job), else the job's.

    Raises:
        LaunchError: a count, list or host list that does not parse, or two of them that disagree (the
            tasks per node against the tasks, the node count, the hosts listed): such a world never forms.
    """
    if "SLURM_STEP_NUM_TASKS" in env:
        names = ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST")
    else:
        tasks_var = "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS"
        nodes_var = "SLURM_JOB_NUM_NODES" if "SLURM_JOB_NUM_NODES" in env else "SLURM_NNODES"
        # the job's hosts; a srun that sets no SLURM_STEP_NUM_TASKS (older SLURM) may still set the step's
        nodelist_var = next(
            (n for n in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST") if n in env),
            "SLURM_JOB_NODELIST",
        )
        names = (tasks_var, nodes_var, "SLURM_TASKS_PER_NODE", nodelist_var)
    tasks_var, nodes_var, per_node_var, nodelist_var = names
    (tasks,) = read_ints(env, [tasks_var], _SLURM_FIX)
    per_node = TasksPerNode(env[per_node_var], per_node_var) if per_node_var in env else None
    hosts = Hostlist(env[nodelist_var], nodelist_var) if nodelist_var in env else None
    if per_node is not None and per_node.total != tasks:
        raise LaunchError(
            f"{shown(per_node_var, env[per_node_var])} adds up to {per_node.total} tasks but {tasks_var}={tasks}; "
            f"{_SLURM_COUNTS_FIX}"
        )
    # every source of the node count that is set must say the same one
    said = [(nodes_var, parse_count(nodes_var, env[nodes_var], _SLURM_FIX))] if nodes_var in env else []
    if per_node is not None:
        said.append((per_node_var, per_node.nodes))
    if hosts is not None:
        said.append((nodelist_var, len(hosts)))
    nodes = said[0][1] if said else 1

    def says(var: str, count: int) -> str:
        return f"{var}={count}" if var == nodes_var else f"{shown(var, env[var])} names {count} nodes"

    for var, count in said[1:]:
        if count != nodes:
            raise LaunchError(
                f"{says(var, count)} but {says(*said[0])}; SLURM writes them alike for one step: {_SLURM_COUNTS_FIX}"
            )
    if nodes == 0:
        raise LaunchError(f"{nodes_var}=0: a SLURM step runs on at least one node; {_SLURM_FIX}")
    if per_node is None and nodes > 1:
        raise LaunchError(
            f"{nodes_var if nodes_var in env else nodelist_var} names {nodes} nodes but {per_node_var} is not set: "
            f"how many of the {tasks_var}={tasks} tasks run on each node is unknown; {_SLURM_FIX}"
        )
    return _SlurmCounts(tasks_var, tasks, nodes_var, nodes, per_node_var, per_node, nodelist_var, hosts)


def _slurm_worker(env: Mapping[str, str]) -> SchedulerWorld:
    counts = _slurm_counts(env)
    rank, local_rank, node = read_ints(env, ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"], _SLURM_FIX)
    world = counts.tasks
    if not 0 <= rank < world:
        raise LaunchError(f"SLURM_PROCID={rank} lies outside {counts.tasks_var}={world} tasks; {_SLURM_FIX}")
    if not node < counts.nodes or not local_rank < counts.on_node(node):
        raise LaunchError(
            f"SLURM_LOCALID={local_rank} on SLURM_NODEID={node} does not fit "
            f"{shown(counts.per_node_var, env.get(counts.per_node_var, str(world)))} on {counts.nodes} node(s); "
            f"{_SLURM_FIX}"
        )
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0"
    return SchedulerWorld(
        scheduler="slurm",
        global_rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=counts.on_node(node),
        node_rank=node,
        master_addr=read_addr(env) or _slurm_master(counts),
        master_port=read_port(env) if "MASTER_PORT" in env else slurm_port(env.get("SLURM_JOB_ID", "0"), step),
    )


def _slurm_master(counts: _SlurmCounts) -> str:
    if counts.hosts is not None:
        return counts.hosts.host(0)  # the first host, computed: the list is never expanded
    raise LaunchError(
        f"a SLURM task without {counts.nodelist_var}: set MASTER_ADDR to rank 0's host "
        "(e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1))"
    )


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
    if "SLURM_PROCID" not in env or not _in_srun_step(env):
        return None, {}
    counts = _slurm_counts(env)
    nodes = counts.nodes
    if counts.tasks != nodes:
        raise LaunchError(
            f"multigpu launch runs once per node and starts the processes itself, but this srun step runs "
            f"{counts.tasks_var}={counts.tasks} tasks on {nodes} node(s); use 'srun --ntasks-per-node=1 multigpu "
            "launch ...'"
        )
    worker = _slurm_worker(env)
    if nodes == 1:  # one node: the launcher's own loopback rendezvous is right
        return "slurm", {"nnodes": "1", "node-rank": "0"}
    values = {
        "nnodes": str(nodes),
        "node-rank": str(worker.node_rank),
        "master-addr": worker.master_addr,
        "master-port": str(worker.master_port),
    }
    return "slurm", values


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


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The SLURM job this process belongs to (``SLURM_JOB_ID``), if any: what ``--requeue`` requeues.

    Raises:
        LaunchError: a value that is no job id (SLURM writes digits): it would reach ``scontrol`` as an
            argument (``--help``, ``-v``, another job's name).
    """
    job = env.get("SLURM_JOB_ID") or None
    if job is not None and re.fullmatch(r"[0-9]{1,20}", job) is None:
        raise LaunchError(
            f"{shown('SLURM_JOB_ID', job)} is not a SLURM job id (SLURM sets digits, e.g. 123456); requeue the "
            "job by hand with 'scontrol requeue <job id>'"
        )
    return job
