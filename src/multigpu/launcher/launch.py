"""Start a training script under a strategy: torchrun's arguments for ``ddp``, one process otherwise.

``multigpu launch`` is a front end to ``torch.distributed.run`` (torchrun): it validates the
options, builds torchrun's argument list and calls it in this process. It never re-implements
rendezvous or collectives. What it adds:

- single-node runs bind the rendezvous store to the loopback address (127.0.0.1), on the given
  port after checking it is free, or else on a port the store picks itself
  (:mod:`multigpu.launcher.torchrun`);
- a per-process thread count (``OMP_NUM_THREADS``): the node's cores divided by its processes,
  unless the user set it;
- what the strategy asks its workers' environment to hold from their start
  (:meth:`~multigpu.strategies.Strategy.launch_env`; fsdp on the CPU: glibc's malloc returning
  freed buffers, :meth:`~multigpu.devices.cpu.CpuDevice.sharded_process_env`);
- each worker runs under :mod:`multigpu.launcher._entry`, whose ``@record`` writes the
  exception to torch elastic's error file, and records its first failure itself in a folder the
  launcher owns (:mod:`multigpu.runtime.failure_records`); the launcher names the rank whose failure
  caused the others and prints its traceback (:mod:`multigpu.launcher.root_cause`);
- a strategy that does not need processes (``single``, ``dp``) runs the script in one ordinary
  process (:mod:`multigpu.launcher.supervise`);
- when a collective times out, the summary names the rank that never reached it, with its stack, from
  what the workers left (:mod:`multigpu.launcher.evidence`); ``--debug`` checks every collective's
  fingerprint (:mod:`multigpu.runtime.tracking`); ``--log-dir``, ``--tee`` and ``--local-ranks-filter``
  are torchrun's own (:func:`multigpu.launcher.torchrun.log_args`).

Example::

    from multigpu.launcher.launch import LaunchConfig, launch
    launch(LaunchConfig(strategy="ddp", nproc_per_node=2), "train.py", ["--epochs", "1"])
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeGuard

from multigpu.core.limits import DAY_S, WEEK_S, check_seconds, parse_nnodes, process_bound
from multigpu.core.lookup import lookup
from multigpu.devices import parse_devices, process_device_type
from multigpu.errors import ConfigError, LaunchError
from multigpu.launcher.fault_tolerant import check_fault_tolerant_options, launch_fault_tolerant
from multigpu.launcher.preemption import maybe_requeue
from multigpu.launcher.preflight import check_log_dir
from multigpu.launcher.supervise import run_supervised
from multigpu.launcher.torchrun import (
    STREAMS,
    build_torchrun_args,
    check_rendezvous_options,
    logs_requested,
    resolve_nproc,
    run_torchrun,
)
from multigpu.runtime.scheduler_world import DEFAULT_PORT
from multigpu.runtime.world import configured_threads
from multigpu.strategies import STRATEGIES, get_strategy
from multigpu.strategies.registry import launched_auto

LAUNCH_STRATEGIES = ("auto", *STRATEGIES)


@dataclass(kw_only=True)
class LaunchConfig:
    """How to start a script. Multi-node fields follow torchrun's meaning.

    Attributes:
        strategy: ``ddp`` (one process per device), ``fsdp`` (the same, model sharded), ``dp`` (one
            process, thread replicas), ``single`` (one process, one device) or ``auto`` (``ddp``, or
            ``single`` for one process).
        nproc_per_node: processes per node, or ``"auto"``: every visible GPU, else 2 on CPU.
        nnodes: node count, or ``"MIN:MAX"`` for an elastic run.
        node_rank: this node's rank (static rendezvous).
        master_addr: rank 0's address; default loopback on one node (required for several nodes
            unless ``rdzv_endpoint`` is given).
        master_port: rank 0's port; None picks a free one on a single node.
        local_addr: this node's address, as the other nodes reach it (several nodes); None:
            torchrun's default, the host name, which inside a container or network namespace
            may resolve to an address the other nodes cannot reach.
        max_restarts: how often torchrun restarts the workers after a failure.
        rdzv_backend: ``static`` (fixed ranks, the default) or ``c10d`` (elastic).
        rdzv_endpoint: ``host:port`` of the c10d rendezvous (``c10d`` backend).
        rdzv_id: a run id shared by all nodes of an elastic run.
        rdzv_conf: extra rendezvous settings, e.g. ``"join_timeout=600"``.
        devices: the ``dp`` strategy's devices (``"cpu:2"``, ``"cuda:0,1"``); None: its default.
        threads_per_process: ``OMP_NUM_THREADS`` per process; None: cores / processes.
        bind_cores: bind each ddp worker to its own slice of the cores
            (:mod:`multigpu.launcher.affinity`); None: on when the node has no GPU.
        collective_timeout_s: seconds a collective waits for a rank that stopped calling it before
            every rank fails with the likely cause (None: 600).
        grace_period_s: after SIGINT, SIGTERM or SIGHUP reaches the launcher (forwarded to every
            worker), how long the workers get to exit before they are killed.
        requeue: under SLURM, after a SIGTERM/SIGUSR1 stopped the run, requeue the job
            (``scontrol requeue``; :mod:`multigpu.launcher.preemption`).
        extra_env: more variables for the workers (on top of the launcher's environment).
        log_dir: write every rank's stdout and stderr to files here (torchrun's ``--log-dir`` layout);
            None: no files (each worker still copies its stderr into the run's temporary failure folder,
            for the failure summary).
        tee: which streams also reach the console (``"none"``, ``"stdout"``, ``"stderr"``, ``"both"``);
            None: both with ``log_dir``, else as usual.
        local_ranks_filter: only these local ranks print on the console (the files keep every rank).
        fault_tolerant: run ``replicas`` replica groups of ``nproc_per_node`` ddp processes that survive each
            other's deaths (torchft; :mod:`multigpu.launcher.fault_tolerant`); ``max_restarts`` is then per group.
        replicas: how many replica groups (``--replicas``, >= 2; with ``fault_tolerant``).
        lighthouse: ``HOST:PORT`` of the groups' lighthouse: node 0's launcher starts it there, the other
            nodes' connect (None: one node, a free port on 127.0.0.1).
        debug: check that every rank issues the same collectives (operation, shapes, call site) and turn
            on torch's checks (``TORCH_DISTRIBUTED_DEBUG``, :func:`multigpu.runtime.world.enable_torch_debug`)
            in every worker.
    """

    strategy: str = "auto"
    nproc_per_node: int | str = "auto"
    nnodes: str = "1"
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    max_restarts: int = 0
    rdzv_backend: str = "static"
    rdzv_endpoint: str | None = None
    rdzv_id: str = "multigpu"
    rdzv_conf: str = ""
    devices: str | None = None
    threads_per_process: int | None = None
    bind_cores: bool | None = None
    collective_timeout_s: float | None = None
    grace_period_s: float = 30.0
    requeue: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    tee: str | None = None
    local_ranks_filter: tuple[int, ...] | None = None
    debug: bool = False
    fault_tolerant: bool = False
    replicas: int | None = None
    lighthouse: str | None = None

    def __post_init__(self) -> None:
        check_fault_tolerant_options(self)  # --fault-tolerant's rules live with it
        choices = ("auto", *STRATEGIES)  # the registry now: a strategy registered later counts
        lookup(
            dict.fromkeys(choices),
            self.strategy,
            "strategy={value!r} is not one of {choices}; use e.g. --strategy ddp",
            choices=choices,
        )
        if self.nproc_per_node != "auto" and (not _is_int(self.nproc_per_node) or self.nproc_per_node < 1):
            raise ConfigError(f"nproc_per_node={self.nproc_per_node!r}: pass a count >= 1 or 'auto'")
        if _is_int(self.nnodes):  # LaunchConfig(nnodes=2): torchrun's form is text
            self.nnodes = str(self.nnodes)
        _, most_nodes = parse_nnodes(self.nnodes)
        if not _is_int(self.node_rank) or not 0 <= self.node_rank < most_nodes:
            raise ConfigError(
                f"node_rank={self.node_rank!r} with nnodes={self.nnodes!r}: pass this node's rank, 0..{most_nodes - 1} "
                "(--node-rank)"
            )
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts={self.max_restarts!r} must be a count >= 0 (--max-restarts)")
        if self.rdzv_backend not in ("static", "c10d"):
            raise ConfigError(f"rdzv_backend={self.rdzv_backend!r}: use 'static' or 'c10d'")
        if self.master_port is not None and (not _is_int(self.master_port) or not 0 < self.master_port < 65536):
            raise ConfigError(f"master_port={self.master_port!r} is not a TCP port; pick one in 1..65535")
        if self.collective_timeout_s is not None:
            check_seconds(self.collective_timeout_s, "collective_timeout_s", maximum_s=WEEK_S)
        check_seconds(self.grace_period_s, "grace_period_s", maximum_s=DAY_S)
        bound = process_bound()
        if self.threads_per_process is not None and (
            not _is_int(self.threads_per_process) or not 1 <= self.threads_per_process <= bound
        ):
            raise ConfigError(
                f"threads_per_process={self.threads_per_process!r}: pass a thread count from 1 to {bound} (4 per CPU "
                "core of this node, at least 8), or leave it out for cores / processes"
            )
        check_log_options(self)
        check_rendezvous_options(self)
        check_extra_env(self.extra_env)
        chosen = get_strategy(self.strategy) if self.strategy != "auto" else None
        one_process = chosen is not None and not chosen.needs_processes
        if one_process and isinstance(self.nproc_per_node, int) and self.nproc_per_node > 1:
            raise ConfigError(
                f"--strategy {self.strategy} runs one process, but --nproc-per-node {self.nproc_per_node} asks for "
                f"{self.nproc_per_node}; use --strategy ddp for one process per device"
                + (
                    f", or --devices cpu:{self.nproc_per_node} for {self.nproc_per_node} dp replicas"
                    if chosen is not None and chosen.launch_devices
                    else ""
                )
            )
        if one_process and self.multi_node:  # e.g. srun --nodes=2 multigpu launch: the scheduler's nnodes
            raise ConfigError(
                f"--strategy {self.strategy} runs one process, but nnodes={self.nnodes!r} asks for several nodes "
                "(each would train alone); use --strategy ddp across nodes, or start one launcher on one node"
            )
        if self.devices is not None and not (chosen is not None and chosen.launch_devices):
            raise ConfigError(
                f"--devices {self.devices} applies to --strategy dp (thread replicas); for ddp choose GPUs with "
                "CUDA_VISIBLE_DEVICES and the count with --nproc-per-node"
            )
        if self.multi_node and self.master_addr is None and self.rdzv_endpoint is None:
            raise ConfigError(
                f"nnodes={self.nnodes!r} spans several nodes: pass --master-addr (rank 0's address, "
                "reachable from every node) or --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
            )

    @property
    def multi_node(self) -> bool:
        return parse_nnodes(self.nnodes)[1] > 1

    @property
    def one_process(self) -> bool:
        """Whether the chosen strategy runs in one ordinary process (``auto`` may not: it depends on the count)."""
        return self.strategy != "auto" and not STRATEGIES[self.strategy].needs_processes


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_strategy(config: LaunchConfig, nproc: int) -> str:
    """``auto`` becomes ``ddp`` for several processes and ``single`` for one."""
    if config.strategy != "auto":
        return config.strategy
    return launched_auto(nproc, multi_node=config.multi_node)


def worker_env(config: LaunchConfig, strategy: str, nproc: int) -> dict[str, str]:
    """The variables every worker gets on top of the launcher's own environment."""
    env = {"MULTIGPU_STRATEGY": strategy, **config.extra_env}
    if config.devices:
        env["MULTIGPU_DEVICES"] = config.devices
    threads = config.threads_per_process or configured_threads()
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // nproc)
    env["OMP_NUM_THREADS"] = str(threads)
    device_type = process_device_type()  # what each worker computes on (runtime.world.process_device)
    bind = config.bind_cores if config.bind_cores is not None else device_type.name == "cpu"
    chosen = STRATEGIES[strategy]
    if bind and chosen.needs_processes:
        env["MULTIGPU_BIND_CORES"] = "1"
    env.update(chosen.launch_env(device_type, {**os.environ, **env}))
    if config.collective_timeout_s is not None:
        env["MULTIGPU_COLLECTIVE_TIMEOUT"] = str(config.collective_timeout_s)
    if not logs_requested(config):  # the worker copies its stderr for the summary (torchrun's files do otherwise)
        env["MULTIGPU_STDERR_COPY"] = "1"
    if config.debug:
        env["MULTIGPU_DEBUG"] = "1"  # the worker turns on torch's checks too (runtime.tracking.setup_worker)
    if config.max_restarts > 0:
        # Restarted gloo workers otherwise may read the previous attempt's addresses from the
        # shared rendezvous store and fail to connect (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def launch(config: LaunchConfig, script: str, script_args: Sequence[str] = ()) -> int:
    """Run ``script`` under ``config.strategy``; returns the exit code (0 when every worker succeeded).

    When ``ddp`` workers fail, the rank whose failure caused the others is printed to stderr with
    its exit code and traceback, then one line per other failed rank.

    Raises:
        LaunchError: the script does not exist, the master port is taken or the master address is
            not this machine's (single node).
        DeviceError: more processes per node than GPUs.
    """
    if not os.path.isfile(script):
        raise LaunchError(f"script {script!r} does not exist; pass the path of a Python file, e.g. examples/train.py")
    nproc = 1 if config.one_process else resolve_nproc(config)
    strategy = resolve_strategy(config, nproc)
    check_ranks_filter(config, nproc)
    if not STRATEGIES[strategy].needs_processes and logs_requested(config):  # torchrun's options: ignored here
        raise ConfigError(
            f"--log-dir, --tee and --local-ranks-filter are the per-rank logs of ddp and fsdp; --strategy {strategy} "
            "runs one process that prints to this console: drop them and redirect it (e.g. > run.log 2>&1), or "
            "launch with --strategy ddp"
        )
    if config.devices is not None:
        parse_devices(config.devices)  # a DeviceError here, not after the script started
    if not STRATEGIES[strategy].needs_processes:
        env = {**os.environ, **worker_env(config, strategy, 1)}
        code = run_supervised([sys.executable, script, *script_args], env, grace_s=config.grace_period_s)
        return maybe_requeue(config, code)
    if config.log_dir is not None:
        check_log_dir(config.log_dir)  # torchrun's own traceback otherwise, after the rendezvous
    if config.fault_tolerant:
        # the node's cores are shared by every group's processes (OMP_NUM_THREADS)
        env = worker_env(config, strategy, nproc * (config.replicas or 1))
        return launch_fault_tolerant(config, script, script_args, env=env, nproc=nproc)
    with tempfile.TemporaryDirectory(prefix="multigpu-failures-") as failure_dir:
        log_dir = (config.log_dir or os.path.join(failure_dir, "logs")) if logs_requested(config) else None
        args = build_torchrun_args(config, script, script_args, log_dir=log_dir)
        if config.multi_node:  # the rendezvous waits silently for the other nodes: say where and for whom
            print(f"multigpu launch: {waiting_message(config, nproc)}", file=sys.stderr, flush=True)
        env = {**worker_env(config, strategy, nproc), "MULTIGPU_FAILURE_DIR": failure_dir}
        return maybe_requeue(config, run_torchrun(config, args, env, script))


def check_log_options(config: LaunchConfig) -> None:
    """Refuse log options torchrun would misread, naming the flag (called by :class:`LaunchConfig`)."""
    if config.tee is not None:
        lookup(
            STREAMS, config.tee, "tee={value!r} is not one of {choices}; use e.g. --tee both", choices=sorted(STREAMS)
        )
    ranks = config.local_ranks_filter
    if ranks is not None and (not ranks or any(not isinstance(r, int) or r < 0 for r in ranks)):
        raise ConfigError(
            f"local_ranks_filter={ranks!r} must name local ranks >= 0; use e.g. --local-ranks-filter 0 (or 0,1)"
        )
    if config.log_dir is not None and os.path.isfile(config.log_dir):
        raise ConfigError(f"--log-dir {config.log_dir} is a file; pass a folder (created when missing)")


# what the launcher and torchrun set in every worker: an extra_env entry would be overridden, or override the
# launcher's own (MULTIGPU_STRATEGY) and run the workers under another strategy than the launch's
_WORKER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_extra_env(extra_env: dict[str, str]) -> None:
    """Refuse ``extra_env`` entries that are not strings, or that name a variable the launch sets itself."""
    if not isinstance(extra_env, dict):
        raise ConfigError(f"extra_env={extra_env!r}: pass a dict of variable names to strings")
    for key, value in extra_env.items():
        if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
            raise ConfigError(f"extra_env[{key!r}]={value!r}: pass variable names mapped to strings, e.g. {{'X': '1'}}")
        if key in _WORKER_VARIABLES or key.startswith("MULTIGPU_"):
            raise ConfigError(
                f"extra_env sets {key}={value!r}, which the launch sets itself in every worker; remove it and use "
                "the LaunchConfig field instead (strategy, nproc_per_node, master_addr, ...)"
            )


def check_ranks_filter(config: LaunchConfig, nproc: int) -> None:
    """Refuse a ``--local-ranks-filter`` naming a local rank this node does not run (it would show nothing)."""
    ranks = config.local_ranks_filter
    missing = sorted(r for r in ranks or () if r >= nproc)
    if missing:
        raise ConfigError(
            f"--local-ranks-filter {','.join(map(str, ranks or ()))} names local rank(s) {missing}, but this node runs "
            f"{nproc} process(es), local ranks 0..{nproc - 1}; pass ranks from that range (e.g. --local-ranks-filter 0)"
        )


def waiting_message(config: LaunchConfig, nproc: int) -> str:
    """What a multi-node launcher says once before its rendezvous waits for the other nodes.

    Example:
        >>> waiting_message(LaunchConfig(nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29500), 4)
        'node 1 of 2 (4 processes here) waiting for the other nodes at 10.0.0.1:29500 (static rendezvous)'
    """
    nodes = config.nnodes.split(":")[-1].strip()
    if config.rdzv_backend == "c10d":
        where = config.rdzv_endpoint or f"{config.master_addr}:{config.master_port or DEFAULT_PORT}"
        return (
            f"{nproc} processes here waiting for {config.nnodes} node(s) to join at {where} "
            f"(c10d rendezvous, id {config.rdzv_id!r})"
        )
    return (
        f"node {config.node_rank} of {nodes} ({nproc} processes here) waiting for the other nodes at "
        f"{config.master_addr}:{config.master_port or DEFAULT_PORT} (static rendezvous)"
    )
