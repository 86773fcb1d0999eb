"""Start a training script under a strategy: torchrun's arguments for ``ddp``, one process otherwise.

``multigpu launch`` is a front end to ``torch.distributed.run`` (torchrun): it validates the
options, builds torchrun's argument list and calls it in this process. It never re-implements
rendezvous or collectives. What it adds:

- single-node runs bind the rendezvous store to the loopback address (127.0.0.1), on the given
  port after checking it is free, or else on a port the store picks itself (c10d on port 0);
- a per-process thread count (``OMP_NUM_THREADS``): the node's cores divided by its processes,
  unless the user set it;
- each worker runs under :mod:`multigpu.distributed._entry`, whose ``@record`` writes the
  exception to torch elastic's error file, so a failing worker's rank and traceback appear in
  the launcher's output;
- ``single`` and ``dp`` run the script in one ordinary process, with the same script.

Example::

    from multigpu.distributed.launch import LaunchConfig, launch
    launch(LaunchConfig(strategy="ddp", nproc_per_node=2), "train.py", ["--epochs", "1"])
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from multigpu.devices import accelerator_type, device_count
from multigpu.distributed.runtime import check_world_matches_devices, configured_threads
from multigpu.errors import ConfigError, LaunchError

LAUNCH_STRATEGIES = ("auto", "single", "dp", "ddp", "fsdp")
_ONE_PROCESS = ("single", "dp")  # every other strategy runs one process per device under torchrun
LOOPBACK = "127.0.0.1"
_ENTRY_MODULE = "multigpu.distributed._entry"
_CPU_AUTO_PROCS = 2  # on CPU, processes share the same cores; 2 exercises the multi-process path


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
        max_restarts: how often torchrun restarts the workers after a failure.
        rdzv_backend: ``static`` (fixed ranks, the default) or ``c10d`` (elastic).
        rdzv_endpoint: ``host:port`` of the c10d rendezvous (``c10d`` backend).
        rdzv_id: a run id shared by all nodes of an elastic run.
        rdzv_conf: extra rendezvous settings, e.g. ``"join_timeout=600"``.
        devices: the ``dp`` strategy's devices (``"cpu:2"``, ``"cuda:0,1"``); None: its default.
        threads_per_process: ``OMP_NUM_THREADS`` per process; None: cores / processes.
        bind_cores: bind each ddp worker to its own slice of the cores
            (:mod:`multigpu.distributed.affinity`); None: on when the node has no GPU.
        collective_timeout_s: seconds a collective waits for a rank that stopped calling it before
            every rank fails with the likely cause (None: 600).
        extra_env: more variables for the workers (on top of the launcher's environment).
    """

    strategy: str = "auto"
    nproc_per_node: int | str = "auto"
    nnodes: str = "1"
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    rdzv_backend: str = "static"
    rdzv_endpoint: str | None = None
    rdzv_id: str = "multigpu"
    rdzv_conf: str = ""
    devices: str | None = None
    threads_per_process: int | None = None
    bind_cores: bool | None = None
    collective_timeout_s: float | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy not in LAUNCH_STRATEGIES:
            raise ConfigError(f"strategy={self.strategy!r} is not one of {LAUNCH_STRATEGIES}; use e.g. --strategy ddp")
        if self.nproc_per_node != "auto" and (not isinstance(self.nproc_per_node, int) or self.nproc_per_node < 1):
            raise ConfigError(f"nproc_per_node={self.nproc_per_node!r}: pass a count >= 1 or 'auto'")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts={self.max_restarts} must be >= 0")
        if self.rdzv_backend not in ("static", "c10d"):
            raise ConfigError(f"rdzv_backend={self.rdzv_backend!r}: use 'static' or 'c10d'")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"master_port={self.master_port} is not a TCP port; pick one in 1..65535")
        if self.collective_timeout_s is not None and self.collective_timeout_s <= 0:
            raise ConfigError(f"collective_timeout_s={self.collective_timeout_s} must be > 0 seconds")
        if self.threads_per_process is not None and self.threads_per_process < 1:
            raise ConfigError(f"threads_per_process={self.threads_per_process} must be >= 1")
        one_process = self.strategy in _ONE_PROCESS
        if one_process and isinstance(self.nproc_per_node, int) and self.nproc_per_node > 1:
            raise ConfigError(
                f"--strategy {self.strategy} runs one process, but --nproc-per-node {self.nproc_per_node} asks for "
                f"{self.nproc_per_node}; use --strategy ddp for one process per device"
                + (
                    f", or --devices cpu:{self.nproc_per_node} for {self.nproc_per_node} dp replicas"
                    if self.strategy == "dp"
                    else ""
                )
            )
        if self.devices is not None and self.strategy != "dp":
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
        return self.nnodes.split(":")[-1].strip() != "1"


def resolve_nproc(config: LaunchConfig) -> int:
    """Processes per node: the configured count, or for ``"auto"`` every GPU, else 2 on CPU.

    Raises:
        DeviceError: on CUDA, more processes than visible GPUs.
    """
    on_cuda = accelerator_type() == "cuda"
    if config.nproc_per_node == "auto":
        return device_count("cuda") if on_cuda else _CPU_AUTO_PROCS
    nproc = int(config.nproc_per_node)
    if on_cuda:
        check_world_matches_devices(nproc, "cuda", device_count("cuda"))
    return nproc


def resolve_strategy(config: LaunchConfig, nproc: int) -> str:
    """``auto`` becomes ``ddp`` for several processes and ``single`` for one."""
    if config.strategy != "auto":
        return config.strategy
    return "ddp" if nproc > 1 or config.multi_node else "single"


def check_port_free(addr: str, port: int) -> None:
    """Fail early, with the fix, when rank 0 cannot listen on ``addr:port`` (instead of a store timeout later).

    Single-node runs bind the rendezvous store on ``addr``. The address family comes from ``addr``
    (``::1`` binds an IPv6 socket). Only "address in use" means the port is taken.

    Raises:
        LaunchError: something listens there already, ``addr`` is not one of this machine's
            addresses (or does not resolve), or the OS refuses the bind (the reason is shown).
    """
    use_local = "single-node runs bind there: pass --master-addr 127.0.0.1, or leave --master-addr out"
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise LaunchError(f"master address {addr!r} does not resolve ({exc.strerror}); {use_local}") from exc
    with socket.socket(family, kind, proto) as sock:
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(
                    f"master port {port} on {addr} is in use ({exc.strerror}); pass another --master-port, "
                    "or leave it out to pick a free port"
                ) from exc
            if exc.errno == errno.EADDRNOTAVAIL:
                raise LaunchError(
                    f"master address {addr} is not one of this machine's addresses ({exc.strerror}); {use_local}"
                ) from exc
            # e.g. EACCES for a port below 1024: neither "in use" nor a foreign address.
            raise LaunchError(
                f"cannot listen on master port {port} on {addr} ({exc.strerror}); {use_local}, and pass a "
                "--master-port of 1024 or more, or leave it out"
            ) from exc


def build_torchrun_args(config: LaunchConfig, script: str, script_args: Sequence[str]) -> list[str]:
    """torchrun's argument list for a ``ddp`` run of ``script`` (ports resolved, checked).

    Example:
        >>> args = build_torchrun_args(LaunchConfig(nproc_per_node=2, master_port=29555), "t.py", [])
        >>> args[:4]
        ['--nnodes', '1', '--nproc-per-node', '2']
    """
    nproc = resolve_nproc(config)
    addr = config.master_addr or LOOPBACK
    port = config.master_port
    backend = config.rdzv_backend
    endpoint: str | None
    if not config.multi_node and port is not None:
        check_port_free(addr, port)
    if not config.multi_node and port is None and config.rdzv_endpoint is None:
        # No port given on one node: the c10d store binds port 0 itself, so no other process can
        # take the port between choosing it and binding it (what torchrun --standalone does).
        backend, endpoint = "c10d", f"{addr}:0"
    else:
        endpoint = config.rdzv_endpoint or (f"{addr}:{port or 29500}" if backend == "c10d" else None)
    args = [
        "--nnodes",
        config.nnodes,
        "--nproc-per-node",
        str(nproc),
        "--node-rank",
        str(config.node_rank),
        "--master-addr",
        addr,
        "--master-port",
        str(port or 29500),
        "--max-restarts",
        str(config.max_restarts),
        "--rdzv-backend",
        backend,
        "--rdzv-id",
        config.rdzv_id,
    ]
    if endpoint:
        args += ["--rdzv-endpoint", endpoint]
    if config.rdzv_conf:
        args += ["--rdzv-conf", config.rdzv_conf]
    if not config.multi_node:
        args += ["--local-addr", addr]
    return [*args, "--module", _ENTRY_MODULE, script, *script_args]


def worker_env(config: LaunchConfig, strategy: str, nproc: int) -> dict[str, str]:
    """The variables every worker gets on top of the launcher's own environment."""
    env = {"MULTIGPU_STRATEGY": strategy, **config.extra_env}
    if config.devices:
        env["MULTIGPU_DEVICES"] = config.devices
    threads = config.threads_per_process or configured_threads()
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // nproc)
    env["OMP_NUM_THREADS"] = str(threads)
    bind = config.bind_cores if config.bind_cores is not None else accelerator_type() != "cuda"
    if bind and strategy not in _ONE_PROCESS:
        env["MULTIGPU_BIND_CORES"] = "1"
    if config.collective_timeout_s is not None:
        env["MULTIGPU_COLLECTIVE_TIMEOUT"] = str(config.collective_timeout_s)
    if config.max_restarts > 0:
        # Restarted gloo workers otherwise may read the previous attempt's addresses from the
        # shared rendezvous store and fail to connect (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def launch(config: LaunchConfig, script: str, script_args: Sequence[str] = ()) -> int:
    """Run ``script`` under ``config.strategy``; returns the exit code (0 when every worker succeeded).

    A failed ``ddp`` worker's rank, exit code and traceback are printed to stderr by torch
    elastic's failure summary.

    Raises:
        LaunchError: the script does not exist, the master port is taken or the master address is
            not this machine's (single node).
        DeviceError: more processes per node than GPUs.
    """
    if not os.path.isfile(script):
        raise LaunchError(f"script {script!r} does not exist; pass the path of a Python file, e.g. examples/train.py")
    nproc = 1 if config.strategy in _ONE_PROCESS else resolve_nproc(config)
    strategy = resolve_strategy(config, nproc)
    if strategy in _ONE_PROCESS:
        env = {**os.environ, **worker_env(config, strategy, 1)}
        return subprocess.call([sys.executable, script, *script_args], env=env)
    return _run_torchrun(build_torchrun_args(config, script, script_args), worker_env(config, strategy, nproc), script)


def _run_torchrun(args: list[str], env: dict[str, str], script: str) -> int:
    # Imported here: torch.distributed.run pulls in the elastic agent, only needed for ddp.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    with _environment(env):
        try:
            run(parse_args(args))
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            print(
                f"multigpu launch: {script} failed on rank {rank} (local_rank {failure.local_rank}, "
                f"exit code {failure.exitcode}); the failing rank's traceback is in the summary below.\n{exc}",
                file=sys.stderr,
                flush=True,
            )
            return 1
    return 0


@contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """Set ``extra`` in os.environ (torchrun hands its environment to the workers), then restore."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
