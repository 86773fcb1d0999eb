"""SLURM's variables: whether this process is a task of an srun step, and the world (or, for ``multigpu
launch``, the nodes) that step's variables imply.

- A task: rank ``SLURM_PROCID``, local rank ``SLURM_LOCALID``, node ``SLURM_NODEID``; the world, tasks per
  node and hosts from the step's variables (``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NUM_NODES``,
  ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_STEP_NODELIST``) when srun set them, else from the job's
  (``SLURM_NTASKS``, ``SLURM_NNODES``, ``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_NODELIST``), never a mix: a step
  may be smaller than its job. Compressed lists are read by :mod:`multigpu.runtime.slurm_lists` (never
  expanded: the count and the first host are computed), and the node count, the hosts and the tasks per
  node must agree, or the tasks would wait for nodes that never come.
- The master is ``MASTER_ADDR``, else the first host; the port ``MASTER_PORT``, else derived from
  ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` (:func:`slurm_port`), so every task computes the same one and two
  steps of one job differ.
- The batch, extern and interactive steps (python run directly in the batch script) are no srun step
  (:func:`in_srun_step`); :func:`not_started_reason` says why such a process is refused.

:mod:`multigpu.runtime.schedulers` decides when SLURM's variables are the ones to read.

Example:
    >>> slurm_port("123456")
    23456
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from multigpu.errors import LaunchError
from multigpu.runtime.scheduler_world import SchedulerWorld, parse_count, read_addr, read_ints, read_port, shown
from multigpu.runtime.slurm_lists import Hostlist, TasksPerNode

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


def not_started_reason(env: Mapping[str, str]) -> str | None:
    """Why a process inside a SLURM allocation that expects several tasks is not one of them, if it is so.

    ``python train.py`` typed in an ``salloc`` shell, or run by an ``sbatch`` script without
    ``srun`` (the batch step, ``SLURM_STEP_ID=batch``), sees ``SLURM_NTASKS`` > 1 but is no task of a
    step: it would wait forever for the others, so the world's caller refuses it with this reason.
    """
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or ""
    several = re.fullmatch(r"0*([2-9]|[1-9][0-9]+)", tasks) is not None  # without int(): it may be 5000 digits
    if "SLURM_JOB_ID" not in env or in_srun_step(env) or not several:
        return None
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    how = f"it runs in SLURM_STEP_ID={step[:40]}, not an srun step" if step else "no SLURM_STEP_ID"
    count = tasks if len(tasks) <= 20 else tasks[:20] + "..."
    return (
        f"this process runs inside SLURM job {env['SLURM_JOB_ID'][:40]}, which expects SLURM_NTASKS={count} tasks, "
        f"but it was not started by srun ({how}); {_SLURM_FIX}"
    )


def in_srun_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of an srun step (its step id is set and names no special step)."""
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


def slurm_worker(env: Mapping[str, str]) -> SchedulerWorld:
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


def slurm_launcher(env: Mapping[str, str]) -> dict[str, str]:
    """``multigpu launch`` in a task of an srun step: one launcher per node, the step's nodes and this node's rank.

    Raises:
        LaunchError: a step of several tasks per node, or variables :func:`slurm_worker` refuses.
    """
    counts = _slurm_counts(env)
    nodes = counts.nodes
    if counts.tasks != nodes:
        raise LaunchError(
            f"multigpu launch runs once per node and starts the processes itself, but this srun step runs "
            f"{counts.tasks_var}={counts.tasks} tasks on {nodes} node(s); use 'srun --ntasks-per-node=1 multigpu "
            "launch ...'"
        )
    worker = slurm_worker(env)
    if nodes == 1:  # one node: the launcher's own loopback rendezvous is right
        return {"nnodes": "1", "node-rank": "0"}
    values = {
        "nnodes": str(nodes),
        "node-rank": str(worker.node_rank),
        "master-addr": worker.master_addr,
        "master-port": str(worker.master_port),
    }
    return values


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
