"""Which scheduler started this process, and the world its variables imply (SLURM, MPI, torchrun's ``PET_*``).

:mod:`multigpu.runtime.world` reads torchrun's ``RANK``/``WORLD_SIZE`` first; a process without
them asks :func:`detect_worker` here, so ``srun python train.py`` and ``mpirun -np 2 python
train.py`` form the same world as ``multigpu launch``:

- **SLURM** (a task of an ``srun`` step): rank ``SLURM_PROCID``, world ``SLURM_NTASKS``, local rank
  ``SLURM_LOCALID``, node ``SLURM_NODEID``, tasks on this node from ``SLURM_TASKS_PER_NODE``; the
  master is the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), expanded by
  :func:`expand_hostlist`; the port is ``MASTER_PORT``, else derived from ``SLURM_JOB_ID`` so every
  task computes the same one.
- **Open MPI** (``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``) and **MPICH / Intel
  MPI** (``PMI_RANK``/``PMI_SIZE``, ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``), with ``MASTER_ADDR`` and
  ``MASTER_PORT`` (loopback and 29500 when every rank runs on this node).

The parent side (``multigpu launch``) asks :func:`launcher_defaults`: torchrun's ``PET_*`` variables
(what Kubeflow's PyTorchJob sets) and, inside a SLURM step, the nodes and this node's rank.
Inconsistent variables raise a :class:`~multigpu.errors.LaunchError` naming them and the fix.

Example:
    >>> expand_hostlist("node[01-03,07],gpu[1-2]")
    ['node01', 'node02', 'node03', 'node07', 'gpu1', 'gpu2']
    >>> detect_worker({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}).global_rank
    1
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from multigpu.errors import LaunchError

DEFAULT_PORT = 29500
TORCHRUN = "torchrun"  # the scheduler name of RANK/WORLD_SIZE (torchrun, multigpu launch) and of PET_*
_PORT_BASE, _PORT_SPAN = 20000, 20000  # job-derived ports: 20000..39999, below Linux's ephemeral range
_SLURM_FIX = "start one task per process with srun (e.g. 'srun --ntasks-per-node=2 python train.py')"


@dataclass(frozen=True)
class SchedulerWorld:
    """The world a scheduler's variables describe, for one process (or, for the launcher, one node).

    Attributes:
        scheduler: ``slurm``, ``openmpi``, ``mpich`` or ``torchrun``.
        global_rank: this process's rank among all.
        local_rank: its rank on its node.
        world_size: processes in the run.
        local_world_size: processes on this node.
        node_rank: this node's rank.
        master_addr: where rank 0's store listens.
        master_port: its port.
    """

    scheduler: str
    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int


def expand_hostlist(hostlist: str) -> list[str]:
    """Every host of a SLURM hostlist, in order: ``"a[1-3,7],b"`` -> ``a1, a2, a3, a7, b``.

    Ranges keep their zero padding (``node[08-10]`` -> ``node08, node09, node10``), and several
    bracket groups in one name multiply (``r[1-2]n[1-2]`` -> ``r1n1, r1n2, r2n1, r2n2``).

    Raises:
        LaunchError: unbalanced brackets or a range that runs backwards.
    """
    hosts: list[str] = []
    for name in _split_top_level(hostlist):
        hosts += _expand_name(name, hostlist)
    return hosts


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise LaunchError(
                f"hostlist {text!r} has unbalanced or nested brackets; SLURM writes e.g. 'node[01-03,07]'"
            )
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise LaunchError(f"hostlist {text!r} has an unclosed '['; SLURM writes e.g. 'node[01-03,07]'")
    return [part.strip() for part in [*parts, current] if part.strip()]


def _expand_name(name: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    expanded: list[str] = []
    for item in match.group(1).split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise LaunchError(f"hostlist {whole!r}: {item!r} is not a number or a range like 01-03")
        if high and int(high) < int(low):
            raise LaunchError(f"hostlist {whole!r}: the range {item!r} runs backwards; write it as {high}-{low}")
        width = len(low)  # SLURM pads every number of a range to its first bound's width
        for number in range(int(low), int(high or low) + 1):
            expanded += [head + str(number).zfill(width) + rest for rest in _expand_name(tail, whole)]
    return expanded


def expand_tasks_per_node(value: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        LaunchError: a value SLURM does not write.
    """
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise LaunchError(f"SLURM_TASKS_PER_NODE={value!r} is not SLURM's form (e.g. '2(x3),1')")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_port(job_id: str) -> int:
    """The port every task of SLURM job ``job_id`` derives alike (when ``MASTER_PORT`` is not set).

    Example:
        >>> slurm_port("123456")
        23456
    """
    digits = re.sub(r"\D", "", job_id) or "0"  # array jobs: '123_4'
    return _PORT_BASE + int(digits) % _PORT_SPAN


def detect_worker(env: Mapping[str, str]) -> SchedulerWorld | None:
    """The world a scheduler started this worker into, or None when none did.

    Args:
        env: the process's environment (``RANK``/``WORLD_SIZE`` are read before this, by the caller).

    Raises:
        LaunchError: the variables contradict each other (the message names them and the fix).
    """
    if "SLURM_PROCID" in env and _in_srun_step(env):
        return _slurm_worker(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _mpi_worker(env, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL")
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _mpi_worker(env, "mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCAL")
    return None


def not_started_reason(env: Mapping[str, str]) -> str | None:
    """Why a process inside a SLURM allocation that expects several tasks is not one of them, if it is so.

    ``python train.py`` typed in an ``salloc`` shell, or run by an ``sbatch`` script without
    ``srun``, sees ``SLURM_NTASKS`` > 1 but is no task of a step: it would wait forever for the
    others, so the world's caller refuses it with this reason.
    """
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if "SLURM_JOB_ID" not in env or _in_srun_step(env) or not tasks or not tasks.isdigit() or int(tasks) <= 1:
        return None
    return (
        f"this process runs inside SLURM job {env['SLURM_JOB_ID']}, which expects SLURM_NTASKS={tasks} tasks, "
        f"but it was not started by srun (no SLURM_STEP_ID); {_SLURM_FIX}"
    )


def _in_srun_step(env: Mapping[str, str]) -> bool:
    # srun sets the step id for its tasks; an sbatch script's own shell (the batch step) has
    # SLURM_PROCID=0 and the allocation's SLURM_NTASKS but is not one of the tasks
    return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env


def _ints(env: Mapping[str, str], names: list[str], fix: str) -> list[int]:
    values = []
    for name in names:
        value = env.get(name, "")
        if not value.strip().isdigit():
            raise LaunchError(f"{name}={value!r} is not a count or index; {fix}")
        values.append(int(value))
    return values


def _slurm_worker(env: Mapping[str, str]) -> SchedulerWorld:
    tasks_name = "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS"
    rank, world, local_rank, node = _ints(
        env, ["SLURM_PROCID", tasks_name, "SLURM_LOCALID", "SLURM_NODEID"], _SLURM_FIX
    )
    if not 0 <= rank < world:
        raise LaunchError(f"SLURM_PROCID={rank} lies outside {tasks_name}={world} tasks; {_SLURM_FIX}")
    per_node = expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"]) if env.get("SLURM_TASKS_PER_NODE") else [world]
    if sum(per_node) != world:
        raise LaunchError(
            f"SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']!r} adds up to {sum(per_node)} tasks but "
            f"{tasks_name}={world}; request consistent counts (e.g. --nodes=2 --ntasks-per-node=2, no --ntasks)"
        )
    if not node < len(per_node) or not local_rank < per_node[node]:
        raise LaunchError(
            f"SLURM_LOCALID={local_rank} on SLURM_NODEID={node} does not fit SLURM_TASKS_PER_NODE="
            f"{env.get('SLURM_TASKS_PER_NODE', str(world))!r}; {_SLURM_FIX}"
        )
    return SchedulerWorld(
        scheduler="slurm",
        global_rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=per_node[node],
        node_rank=node,
        master_addr=env.get("MASTER_ADDR") or _slurm_master(env),
        master_port=_port(env) if "MASTER_PORT" in env else slurm_port(env.get("SLURM_JOB_ID", "0")),
    )


def _slurm_master(env: Mapping[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            return expand_hostlist(env[name])[0]
    raise LaunchError(
        "a SLURM task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: set MASTER_ADDR to rank 0's host "
        "(e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1))"
    )


def _mpi_worker(env: Mapping[str, str], name: str, rank_var: str, size_var: str, local: str) -> SchedulerWorld:
    fix = "start the processes with mpirun (e.g. 'mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT python train.py')"
    rank, world = _ints(env, [rank_var, size_var], fix)
    local_rank_var, local_size_var = (
        (f"{local}_RANK", f"{local}_SIZE") if name == "openmpi" else (f"{local}RANKID", f"{local}NRANKS")
    )
    local_rank, local_world = (
        _ints(env, [local_rank_var, local_size_var], fix) if local_rank_var in env else (rank, world)
    )
    if not 0 <= rank < world:
        raise LaunchError(f"{rank_var}={rank} lies outside {size_var}={world} processes; {fix}")
    if not 0 <= local_rank < local_world <= world:
        raise LaunchError(
            f"{local_rank_var}={local_rank} and {local_size_var}={local_world} do not fit {size_var}={world}; {fix}"
        )
    if "MASTER_ADDR" not in env and local_world < world:
        raise LaunchError(
            f"{name} started {world} processes on several nodes ({local_size_var}={local_world}) but MASTER_ADDR "
            "is not set: export MASTER_ADDR (rank 0's host) and MASTER_PORT and pass them with mpirun -x"
        )
    return SchedulerWorld(
        scheduler=name,
        global_rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=rank // local_world if local_world else 0,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_port(env),
    )


def _port(env: Mapping[str, str]) -> int:
    value = env.get("MASTER_PORT", str(DEFAULT_PORT))
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise LaunchError(f"MASTER_PORT={value!r} is not a TCP port; set it to one in 1..65535 on every process")
    return int(value)


# -- the launcher's side ---------------------------------------------------------------------------

# torchrun's own variables (its arguments' env fallbacks), by multigpu launch's long flag name
_PET_FLAGS = {
    "nnodes": "PET_NNODES",
    "node-rank": "PET_NODE_RANK",
    "nproc-per-node": "PET_NPROC_PER_NODE",
    "master-addr": "PET_MASTER_ADDR",
    "master-port": "PET_MASTER_PORT",
    "rdzv-backend": "PET_RDZV_BACKEND",
    "rdzv-endpoint": "PET_RDZV_ENDPOINT",
    "rdzv-id": "PET_RDZV_ID",
    "rdzv-conf": "PET_RDZV_CONF",
    "max-restarts": "PET_MAX_RESTARTS",
}


# torchrun's words for --nproc-per-node, as multigpu launch reads them: one per GPU, or one per core
_NPROC_WORDS = {"gpu": lambda: "auto", "cpu": lambda: str(os.cpu_count() or 1)}


def launcher_defaults(env: Mapping[str, str]) -> tuple[str | None, dict[str, str]]:
    """What the scheduler says ``multigpu launch`` on this node should use, by long flag name.

    Returns:
        ``(scheduler, values)``: ``("torchrun", ...)`` from ``PET_*``, ``("slurm", ...)`` from a task
        of an srun step (nodes, node rank, master address and port), or ``(None, {})``. Flags given
        on the command line or in a config file win over these.

    Raises:
        LaunchError: an srun step that starts more than one launcher per node.
    """
    pet = {flag: env[name] for flag, name in _PET_FLAGS.items() if env.get(name)}
    if pet.get("nproc-per-node") in _NPROC_WORDS:  # a PyTorchJob's nprocPerNode: auto, gpu, cpu or a count
        pet["nproc-per-node"] = _NPROC_WORDS[pet["nproc-per-node"]]()
    if pet:
        # a PyTorchJob also sets MASTER_ADDR/MASTER_PORT (older operators set no PET_MASTER_*): rank 0's pod
        for flag, name in (("master-addr", "MASTER_ADDR"), ("master-port", "MASTER_PORT")):
            if flag not in pet and env.get(name):
                pet[flag] = env[name]
        return TORCHRUN, pet
    if "SLURM_PROCID" not in env or not _in_srun_step(env):
        return None, {}
    tasks, nodes = env.get("SLURM_NTASKS", "1"), env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES", "1")
    if tasks != nodes:
        raise LaunchError(
            f"multigpu launch runs once per node and starts the processes itself, but this srun step runs "
            f"SLURM_NTASKS={tasks} tasks on {nodes} node(s); use 'srun --ntasks-per-node=1 multigpu launch ...'"
        )
    worker = _slurm_worker(env)
    if nodes == "1":  # one node: the launcher's own loopback rendezvous is right
        return "slurm", {"nnodes": "1", "node-rank": "0"}
    values = {
        "nnodes": nodes,
        "node-rank": str(worker.node_rank),
        "master-addr": worker.master_addr,
        "master-port": str(worker.master_port),
    }
    return "slurm", values


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The SLURM job this process belongs to (``SLURM_JOB_ID``), if any: what ``--requeue`` requeues."""
    return env.get("SLURM_JOB_ID") or None
