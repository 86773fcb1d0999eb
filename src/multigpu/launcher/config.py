"""How to start a script: :class:`LaunchConfig`, the one object ``multigpu launch``, the probes and
``advise --measure`` build, and the checks it makes of itself when built.

The launcher's modules take it (:mod:`multigpu.launcher.launch`, :mod:`multigpu.launcher.torchrun`,
:mod:`multigpu.launcher.preemption`, :mod:`multigpu.launcher.environment`); it imports none of them, so
no two of them import each other through it.

Example:
    >>> LaunchConfig(strategy="ddp", nproc_per_node=2).multi_node
    False
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TypeGuard

from multigpu.core.limits import DAY_S, WEEK_S, check_seconds, parse_nnodes, process_bound
from multigpu.core.lookup import lookup
from multigpu.errors import ConfigError
from multigpu.runtime.worker_env import WorkerEnv, owned_variable
from multigpu.strategies import STRATEGIES, get_strategy

LAUNCH_STRATEGIES = ("auto", *STRATEGIES)
RDZV_BACKENDS = ("static", "c10d")  # torchrun's rendezvous backends multigpu launch passes on


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
        if _is_int(self.nnodes):  # LaunchConfig(nnodes=2): torchrun's form is text
            self.nnodes = str(self.nnodes)
        check_fault_tolerant_options(self)
        choices = ("auto", *STRATEGIES)  # the registry now: a strategy registered later counts
        lookup(
            dict.fromkeys(choices),
            self.strategy,
            "strategy={value!r} is not one of {choices}; use e.g. --strategy ddp",
            choices=choices,
        )
        if self.nproc_per_node != "auto" and (not _is_int(self.nproc_per_node) or self.nproc_per_node < 1):
            raise ConfigError(f"nproc_per_node={self.nproc_per_node!r}: pass a count >= 1 or 'auto'")
        _, most_nodes = parse_nnodes(self.nnodes)
        if not _is_int(self.node_rank) or not 0 <= self.node_rank < most_nodes:
            raise ConfigError(
                f"node_rank={self.node_rank!r} with nnodes={self.nnodes!r}: pass this node's rank, 0..{most_nodes - 1} "
                "(--node-rank)"
            )
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts={self.max_restarts!r} must be a count >= 0 (--max-restarts)")
        lookup(
            dict.fromkeys(RDZV_BACKENDS),
            self.rdzv_backend,
            "rdzv_backend={value!r} is not one of {choices}; pass --rdzv-backend static (fixed ranks) or c10d",
        )
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
        threads = WorkerEnv.variable("threads")
        if self.threads_per_process is not None and threads in self.extra_env:
            raise ConfigError(
                f"threads_per_process={self.threads_per_process} and extra_env's "
                f"{threads}={self.extra_env[threads]!r} both set the threads per process; keep one"
            )
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
        # fault-tolerant groups rendezvous on their own node and meet at --lighthouse: no master address to pass
        if self.multi_node and self.master_addr is None and self.rdzv_endpoint is None and not self.fault_tolerant:
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


# torchrun's numbers for the standard streams (its Std flags), by the names --tee takes
STREAMS = {"none": 0, "stdout": 1, "stderr": 2, "both": 3}


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


def check_extra_env(extra_env: dict[str, str]) -> None:
    """Refuse ``extra_env`` entries that are not strings, or that name a variable the launch sets itself."""
    if not isinstance(extra_env, dict):
        raise ConfigError(f"extra_env={extra_env!r}: pass a dict of variable names to strings")
    for key, value in extra_env.items():
        if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
            raise ConfigError(f"extra_env[{key!r}]={value!r}: pass variable names mapped to strings, e.g. {{'X': '1'}}")
        # what the launcher and torchrun set in every worker: an extra_env entry would be overridden, or override
        # the launcher's own (MULTIGPU_STRATEGY) and run the workers under another strategy than the launch's
        if owned_variable(key):
            raise ConfigError(
                f"extra_env sets {key}={value!r}, which the launch sets itself in every worker; remove it and use "
                "the LaunchConfig field instead (strategy, nproc_per_node, master_addr, ...)"
            )


def check_rendezvous_options(config: LaunchConfig) -> None:
    """Refuse rendezvous options torchrun would fail on with a traceback, or silently misread, naming the flag
    (called by :class:`LaunchConfig`).

    Raises:
        ConfigError: an empty address or run id (torchrun would pick the loopback address, or a random id that
            the other nodes cannot share), an endpoint whose port is not one, or ``--rdzv-conf`` that is not
            ``KEY=VALUE,...``.
    """
    for flag, value in (
        ("--master-addr", config.master_addr),
        ("--local-addr", config.local_addr),
        ("--rdzv-endpoint", config.rdzv_endpoint),
    ):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{flag} {value!r} is empty; pass an address (e.g. 10.0.0.1) or leave the flag out")
    if not isinstance(config.rdzv_id, str) or not config.rdzv_id.strip():
        raise ConfigError(
            f"--rdzv-id {config.rdzv_id!r} is empty (torchrun would make up a different one on every node); pass one "
            "id that every node shares, e.g. --rdzv-id job42, or leave it out"
        )
    if config.rdzv_endpoint is not None:
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        try:
            parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=29400)
        except ValueError as exc:
            raise ConfigError(
                f"--rdzv-endpoint {config.rdzv_endpoint!r}: {exc} Pass HOST:PORT, e.g. 10.0.0.1:29400"
            ) from None
    pairs = [part.split("=", 1) for part in config.rdzv_conf.split(",")] if config.rdzv_conf else []
    bad = [part for part in pairs if len(part) != 2 or not part[0].strip() or not part[1].strip()]
    if bad:
        raise ConfigError(
            f"--rdzv-conf {config.rdzv_conf!r}: {'='.join(bad[0])!r} is not KEY=VALUE; pass settings as "
            "KEY=VALUE,... e.g. --rdzv-conf join_timeout=600"
        )


def logs_requested(config: LaunchConfig) -> bool:
    """Whether the user asked for per-rank logs (``--log-dir``, ``--tee`` or ``--local-ranks-filter``)."""
    return config.log_dir is not None or config.tee is not None or config.local_ranks_filter is not None


def check_fault_tolerant_options(config: LaunchConfig) -> None:
    """Refuse ``--fault-tolerant`` settings that cannot run (:mod:`multigpu.launcher.fault_tolerant`), naming the flag."""
    replicas = config.replicas
    if not config.fault_tolerant:
        if replicas is not None or config.lighthouse is not None:
            raise ConfigError(
                f"--replicas {replicas} / --lighthouse {config.lighthouse} apply to fault-tolerant replica groups; "
                "add --fault-tolerant (or drop them)"
            )
        return
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
        raise ConfigError(
            f"--fault-tolerant needs --replicas R with R >= 2 replica groups (got replicas={replicas!r}): one group "
            "has nobody to survive it; pass e.g. --replicas 2"
        )
    if config.strategy != "ddp":
        raise ConfigError(f"--fault-tolerant runs ddp replica groups; pass --strategy ddp (got {config.strategy!r})")
    if (
        isinstance(config.nnodes, str) and ":" in config.nnodes
    ):  # each node's groups are numbered from its --node-rank, which an elastic run has not
        raise ConfigError(
            f"--fault-tolerant with nnodes={config.nnodes!r}: an elastic node count gives the nodes no fixed rank, "
            "so their replica groups would share numbers; pass a fixed count (e.g. --nnodes 2) and --node-rank"
        )
    if config.multi_node and config.lighthouse is None:
        raise ConfigError(
            f"--fault-tolerant over nnodes={config.nnodes!r}: pass --lighthouse HOST:PORT to every node's launcher "
            "(node 0's starts it there)"
        )
    if config.lighthouse is not None and (
        ":" not in config.lighthouse or not config.lighthouse.rsplit(":", 1)[1].isdigit()
    ):
        raise ConfigError(f"--lighthouse {config.lighthouse!r} is not HOST:PORT; pass e.g. --lighthouse 10.0.0.1:29600")
