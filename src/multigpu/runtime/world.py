"""The process's place in a multi-process run: launch environment, process group, main process.

This is the one module that reads the launcher's environment variables: torch's (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, through
:mod:`multigpu.runtime.schedulers`), multigpu's own ``MULTIGPU_*`` settings and ``OMP_NUM_THREADS``, decoded
by :class:`~multigpu.runtime.worker_env.WorkerEnv` (:func:`worker_settings`), torch elastic's
``TORCHELASTIC_RESTART_COUNT``, torch's ``TORCH_DISTRIBUTED_DEBUG`` (set for ``--debug``:
:func:`enable_torch_debug`) and the user's ``MULTIGPU_CACHE_DIR`` / ``XDG_CACHE_HOME`` (:func:`cache_dir`); which
scheduler started the process and the world its variables say (torchrun's, a PyTorchJob pod's, MPI's, SLURM's)
it asks :mod:`multigpu.runtime.schedulers`, whose one priority tuple decides.
Everything else asks :func:`read_launch_env`. It is also the one place that answers "which rank
am I, is a process group up, am I the main process" (:func:`global_rank`, :func:`world_size`,
:func:`in_process_group`, :func:`is_main_process`): the collectives, the failure messages, the
profilers and the checkpoints ask it.

One process's life under ``multigpu launch`` (or torchrun)::

    env = read_launch_env()                  # None when not started by a launcher
    setup_process_group(env)                 # nccl on CUDA, gloo on CPU; every rank calls it
    ...                                      # train
    teardown_process_group()                 # every rank calls it
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from multigpu.devices import device_type_names, get_device_type, process_device_type
from multigpu.errors import DeviceError, LaunchError
from multigpu.runtime import schedulers
from multigpu.runtime.group_store import group_store
from multigpu.runtime.scheduler_world import parse_count
from multigpu.runtime.worker_env import RESTART_COUNT, WorkerEnv

DEFAULT_TIMEOUT_S = 600.0

_torch_debug = False  # enable_torch_debug was called: setup_process_group sets the level for its backend

_LAUNCH_HINT = (
    "start the script with a launcher, e.g. "
    "'multigpu launch --strategy ddp --nproc-per-node 2 script.py' (or torchrun), "
    "or use strategy='single' / 'dp' / 'auto' to run in this one process"
)


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process about the run (all from environment variables).

    Attributes:
        global_rank: this process's rank among all processes of the run.
        local_rank: its rank among the processes on this node (also its device index on GPUs).
        world_size: how many processes the run has, on all nodes.
        local_world_size: how many processes run on this node.
        master_addr: address of the rank-0 store every process connects to.
        master_port: port of that store.
        scheduler: who set the variables: ``torchrun`` (also ``multigpu launch``), ``pytorchjob`` (a
            pod that runs the script directly), ``slurm``, ``openmpi`` or ``mpich``
            (:mod:`multigpu.runtime.schedulers`).
    """

    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    scheduler: str = schedulers.TORCHRUN

    @property
    def is_main_process(self) -> bool:
        return self.global_rank == 0 and (replica_group() or 0) == 0  # --fault-tolerant: group 0's rank 0


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launch environment of this process, or None when no launcher started it.

    Args:
        environ: the variables to read (default: ``os.environ``).

    Returns:
        The world the first scheduler of :data:`multigpu.runtime.schedulers.SCHEDULERS` that detects
        this process describes (torchrun's ``RANK``/``WORLD_SIZE``, a PyTorchJob pod's, MPI's, SLURM's),
        else None (also in the one process of ``multigpu launch --strategy single|dp``, which inherits
        MPI's or SLURM's).

    Raises:
        LaunchError: the variables are present but inconsistent (e.g. ``RANK`` >= ``WORLD_SIZE``).

    Example:
        >>> read_launch_env({"RANK": "1", "WORLD_SIZE": "2"}).local_rank
        1
    """
    env = os.environ if environ is None else environ
    # the one process of a multigpu launch (single, dp): the launcher was the scheduler's task; SLURM's or
    # MPI's variables it inherited are not its world (torch's, set for it, still are)
    found = schedulers.detect_worker(env, launched_alone=bool(env.get(WorkerEnv.variable("strategy"))))
    if found is None:
        return None
    return LaunchEnv(
        global_rank=found.global_rank,
        local_rank=found.local_rank,
        world_size=found.world_size,
        local_world_size=found.local_world_size,
        master_addr=found.master_addr,
        master_port=found.master_port,
        scheduler=found.scheduler,
    )


def require_launch_env(what: str) -> LaunchEnv:
    """The launch environment, or a :class:`LaunchError` that says how to launch ``what``."""
    env = read_launch_env()
    if env is None:
        reason = schedulers.not_started_reason(os.environ)
        if reason is not None:
            raise LaunchError(f"{what} needs one process per task: {reason}")
        raise LaunchError(f"{what} needs a launched process, but RANK/WORLD_SIZE are not set; {_LAUNCH_HINT}")
    return env


def scheduler_launcher_defaults() -> tuple[str | None, dict[str, str]]:
    """What this node's scheduler says ``multigpu launch`` should use, by long flag name
    (:func:`multigpu.runtime.schedulers.launcher_defaults`: ``PET_*``, or a SLURM step)."""
    return schedulers.launcher_defaults(os.environ)


def slurm_job_id() -> str | None:
    """The SLURM job this process runs in (``SLURM_JOB_ID``), if any."""
    return schedulers.slurm_job_id(os.environ)


def scheduler_report() -> dict[str, str]:
    """What ``multigpu env`` shows of the start: the scheduler detected and the world it implies."""
    rows: dict[str, str] = {}
    try:
        env = read_launch_env()
    except LaunchError as exc:
        env, rows["worker"] = None, f"refused: {exc}"
    if env is not None:
        rows["scheduler"] = env.scheduler
        rows["world"] = (
            f"rank {env.global_rank} of {env.world_size} (local rank {env.local_rank} of {env.local_world_size}), "
            f"master {env.master_addr}:{env.master_port}"
        )
    else:
        reason = schedulers.not_started_reason(os.environ)
        rows.setdefault("scheduler", "none (one process)" if reason is None else f"none: {reason}")
    try:
        launcher_scheduler, values = scheduler_launcher_defaults()
    except LaunchError as exc:
        rows["multigpu launch here"] = f"refused: {exc}"
    else:
        if launcher_scheduler is not None:
            flags = " ".join(f"--{flag} {value}" for flag, value in values.items())
            rows["multigpu launch here"] = f"{launcher_scheduler}: {flags}"
    return rows


def worker_settings() -> WorkerEnv:
    """What the launcher asked of this process (``MULTIGPU_*``, ``OMP_NUM_THREADS``); a plain process: the defaults.

    Raises:
        LaunchError: one of the variables does not parse (named, with its value and the fix).
    """
    return WorkerEnv.from_environ(os.environ)


def requested_strategy() -> str | None:
    """The strategy ``multigpu launch --strategy`` asked for (``MULTIGPU_STRATEGY``), if any."""
    return worker_settings().strategy


def requested_devices() -> str | None:
    """The devices ``multigpu launch --devices`` asked for (``MULTIGPU_DEVICES``), if any."""
    return worker_settings().devices


def bind_cores_requested() -> bool:
    """Whether ``multigpu launch`` asked this worker to bind to its share of the cores (``MULTIGPU_BIND_CORES``)."""
    return worker_settings().bind_cores


def collective_timeout_s() -> float:
    """Seconds a collective waits for a missing rank (``multigpu launch --collective-timeout``, else 600)."""
    seconds = worker_settings().collective_timeout_s
    return DEFAULT_TIMEOUT_S if seconds is None else seconds


def failure_dir() -> str | None:
    """Where this worker records its failure for the launcher's summary (``MULTIGPU_FAILURE_DIR``), if set."""
    return worker_settings().failure_dir


def stderr_copy_requested() -> bool:
    """Whether ``multigpu launch`` asked this worker to copy its stderr for the summary (``MULTIGPU_STDERR_COPY``)."""
    return worker_settings().stderr_copy


def debug_requested() -> bool:
    """Whether ``multigpu launch --debug`` asked for the collective checks (``MULTIGPU_DEBUG``)."""
    return worker_settings().debug


def enable_torch_debug() -> None:
    """Turn on torch's own collective checks in this process (``TORCH_DISTRIBUTED_DEBUG``).

    Before the process group is created, at the level of the backend workers use here
    (:func:`~multigpu.devices.process_device_type`'s; :func:`torch_debug_level`);
    :func:`setup_process_group` sets it again from the backend it creates the group with (a rank
    of a GPU machine that trains on the CPU uses gloo). A group the script creates itself keeps
    the first level.
    """
    global _torch_debug
    _torch_debug = True
    _apply_torch_debug(process_device_type().backend)


def torch_debug_level(backend: str) -> str:
    """The ``TORCH_DISTRIBUTED_DEBUG`` level ``--debug`` sets for a group of ``backend``.

    ``DETAIL`` (torch wraps the group in its checking wrapper, which compares every collective's
    shapes across ranks), but ``INFO`` wherever gloo serves (DDP's runtime logging, unused
    parameters by name): torch 2.13's CPU build crashes (SIGSEGV) building DDP over a gloo group
    wrapped for ``DETAIL`` (reproduced with a plain torchrun script); multigpu's own fingerprint
    check covers its collectives there.

    Example:
        >>> torch_debug_level("nccl"), torch_debug_level("cpu:gloo,cuda:nccl")
        ('DETAIL', 'INFO')
    """
    return "INFO" if "gloo" in backend else "DETAIL"


def _apply_torch_debug(backend: str) -> None:
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = torch_debug_level(backend)
    if dist.is_available():
        dist.set_debug_level_from_env()


def restart_count() -> int:
    """How often torch elastic has restarted this run's workers (``TORCHELASTIC_RESTART_COUNT``; 0 if unset)."""
    value = os.environ.get(RESTART_COUNT, "0")
    return parse_count(RESTART_COUNT, value, "torchrun sets it (0, 1, ... per restart); unset it if set by hand")


def configured_threads() -> int | None:
    """The per-process thread count the user set (``OMP_NUM_THREADS``), if any (only it is read: the launcher
    asks this before it starts workers, whatever ``MULTIGPU_*`` variables its own environment holds)."""
    threads: int | None = WorkerEnv.read(os.environ, "threads")
    return threads


def cache_dir() -> Path:
    """Where multigpu keeps what it measured of this machine (the planner's calibration, the peak FLOPs):
    ``MULTIGPU_CACHE_DIR``, else ``$XDG_CACHE_HOME/multigpu``, else ``~/.cache/multigpu``."""
    chosen = os.environ.get("MULTIGPU_CACHE_DIR") or ""
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multigpu"


def choose_backend(device_type: str) -> str:
    """The collective backend for ``device_type``, as its device type says (``nccl`` on CUDA); the CPU's
    (``gloo``) for a type nobody registered.

    Example:
        >>> choose_backend("cpu")
        'gloo'
    """
    return get_device_type(device_type if device_type in device_type_names() else "cpu").backend


def process_device(env: LaunchEnv) -> torch.device:
    """The device this process computes on: ``<type>:<local_rank>`` of the type
    :func:`~multigpu.devices.process_device_type` names (CUDA's where there are GPUs), else the CPU.

    A task that a scheduler (SLURM, MPI) started seeing a single device takes it, whatever its local
    rank: the scheduler bound one GPU to each task (``srun --gpus-per-task=1``).

    Raises:
        DeviceError: more processes on this node than visible devices of that type.
    """
    kind = process_device_type()
    if kind.name == "cpu":
        return torch.device("cpu")
    visible = kind.device_count()
    if env.scheduler != schedulers.TORCHRUN and visible == 1:
        return torch.device(kind.name, 0)  # the scheduler bound one device to this task (srun --gpus-per-task=1)
    check_world_matches_devices(env.local_world_size, kind.name, visible)
    return torch.device(kind.name, env.local_rank)


def check_world_matches_devices(local_world_size: int, device_type: str, available: int) -> None:
    """Fail when a node runs more processes than it has devices of ``device_type`` (CPU: any count).

    Args:
        local_world_size: processes launched on this node.
        device_type: the device type each process would use.
        available: how many such devices the node has.

    Raises:
        DeviceError: naming both counts and the flag to change.

    Example:
        >>> check_world_matches_devices(2, "cuda", 2)
    """
    if device_type == "cpu" or local_world_size <= available:
        return
    raise DeviceError(
        f"{local_world_size} processes per node were launched but this node sees {available} "
        f"{device_type} device(s); one process per device: relaunch with --nproc-per-node {available} "
        "(or --nproc-per-node auto)"
    )


def setup_process_group(env: LaunchEnv, device: torch.device, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the run's process group (idempotent). Every rank must call it.

    Args:
        env: from :func:`read_launch_env`.
        device: this process's device (decides the backend; on CUDA it becomes the current device).
        timeout_s: how long collectives wait for a missing rank before failing instead of hanging.

    Returns:
        True when this call created the group; False when one existed (its owner tears it down).

    Example:
        >>> setup_process_group(require_launch_env("training"), torch.device("cpu"))  # doctest: +SKIP
        True
    """
    if dist.is_initialized():
        return False
    get_device_type(device.type).set_device(device)  # one process per device: make it the current one
    backend = choose_backend(device.type)
    if _torch_debug:  # --debug: the level follows the backend this group really uses (torch reads it now)
        _apply_torch_debug(backend)
    timeout = timedelta(seconds=timeout_s)
    # the run's one store, keys under this group's own prefix: a second Session met the first one's keys
    store = group_store(
        _url_host(env.master_addr), env.master_port, rank=env.global_rank, world_size=env.world_size, timeout=timeout
    )
    dist.init_process_group(
        backend=backend, store=store, rank=env.global_rank, world_size=env.world_size, timeout=timeout
    )
    return True


def teardown_process_group() -> None:
    """Leave the process group if this process is in one (safe to call twice). Every rank calls it."""
    if in_process_group():
        dist.destroy_process_group()


def in_process_group() -> bool:
    """Whether this process is in an initialized default process group (collectives communicate).

    Example:
        >>> in_process_group()
        False
    """
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    """This process's rank: the process group's when one is up, else the launcher's ``RANK``, else 0.

    Example:
        >>> global_rank()
        0
    """
    if in_process_group():
        return dist.get_rank()
    env = read_launch_env()
    return env.global_rank if env is not None else 0


def world_size() -> int:
    """How many processes the run has: the process group's size, else the launcher's ``WORLD_SIZE``, else 1.

    Example:
        >>> world_size()
        1
    """
    if in_process_group():
        return dist.get_world_size()
    env = read_launch_env()
    return env.world_size if env is not None else 1


def is_main_process() -> bool:
    """True on global rank 0 (:func:`global_rank`), so in any process not started by a launcher.

    A process a launcher started with ``RANK=1`` is not the main process even before it joins
    the process group; under ``--fault-tolerant``, rank 0 of replica group 0 alone is (each group's
    ranks count from 0).

    Example:
        >>> is_main_process()
        True
    """
    return global_rank() == 0 and (replica_group() or 0) == 0


# -- fault-tolerant replica groups (multigpu launch --fault-tolerant; multigpu.runtime.replica_groups) --


def replica_group() -> int | None:
    """This worker's replica group, 0..R-1 (``MULTIGPU_REPLICA_GROUP``); None outside ``--fault-tolerant``."""
    return worker_settings().replica_group


def replica_groups() -> int | None:
    """How many replica groups the run has (``MULTIGPU_REPLICA_GROUPS``); None outside ``--fault-tolerant``."""
    return worker_settings().replica_groups


def lighthouse_address() -> str | None:
    """The torchft lighthouse the replica groups meet at (``MULTIGPU_LIGHTHOUSE``, ``http://host:port``)."""
    return worker_settings().lighthouse


def run_token() -> str | None:
    """The launch's run token (``MULTIGPU_RUN_ID``), the same in every group and restart of one launch; None: unset.

    Raises:
        LaunchError: it is set but not a token (1 to 64 letters, digits, ``.``, ``_``, ``-``), named with the fix.
    """
    return WorkerEnv.read(os.environ, "run_token")


def supervisor_pid() -> int | None:
    """The launcher this worker dies with (``MULTIGPU_SUPERVISOR``); None outside ``--fault-tolerant``."""
    return worker_settings().supervisor


def _url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
