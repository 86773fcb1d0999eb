"""torchrun underneath ``multigpu launch --strategy ddp|fsdp``: its argument list, and the call into it.

multigpu never re-implements rendezvous or collectives: :func:`build_torchrun_args` writes the
argument list ``torchrun`` would be given, and :func:`run_torchrun` calls ``torch.distributed.run``
in this process with it, then turns what torch elastic raises into a launcher's answer (an exit
code, a failure summary naming the root-cause rank, a :class:`~multigpu.errors.LaunchError` when
the nodes never met). Single-node runs bind the rendezvous store to the loopback address, on the
given port after checking it is free, or else on a port the store picks itself (c10d on port 0).

Example:
    >>> from multigpu.launcher.config import LaunchConfig
    >>> build_torchrun_args(LaunchConfig(nproc_per_node=2, master_port=29555), "t.py", [])[:4]
    ['--nnodes', '1', '--nproc-per-node', '2']
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from multigpu.devices import process_device_type
from multigpu.errors import LaunchError
from multigpu.launcher import evidence, slow_ranks
from multigpu.launcher.config import STREAMS, LaunchConfig
from multigpu.launcher.preflight import check_listen_address, check_process_count
from multigpu.launcher.root_cause import format_summary, from_torch, merge
from multigpu.runtime import failure_records
from multigpu.runtime.scheduler_world import DEFAULT_PORT
from multigpu.runtime.worker_env import WorkerEnv
from multigpu.runtime.world import check_world_matches_devices

LOOPBACK = "127.0.0.1"
ENTRY_MODULE = "multigpu.launcher._entry"


def resolve_nproc(config: LaunchConfig) -> int:
    """Processes per node: the configured count, or for ``"auto"`` one per device of the type the
    workers compute on (:func:`~multigpu.devices.process_device_type`), as many as the type's
    ``default_replicas`` (every GPU, else 2 on CPU).

    Raises:
        DeviceError: more processes than visible devices of that type (GPUs).
    """
    kind = process_device_type()
    if config.nproc_per_node == "auto":
        return kind.default_replicas()  # every GPU; 2 on the CPU, whose processes share its cores
    nproc = int(config.nproc_per_node)
    check_world_matches_devices(nproc, kind.name, kind.device_count())  # any count on the CPU...
    if kind.name == "cpu":  # ... that the node can run
        check_process_count(nproc, "--nproc-per-node ", fix="spread the world over several nodes (--nnodes)")
    return nproc


def build_torchrun_args(
    config: LaunchConfig, script: str, script_args: Sequence[str], *, log_dir: str | None = None
) -> list[str]:
    """torchrun's argument list for a ``ddp`` run of ``script`` (ports resolved, checked).

    Args:
        config: the launch's configuration (processes per node: :func:`resolve_nproc`).
        script: the training script each worker runs under :data:`ENTRY_MODULE`.
        script_args: its arguments (the module docstring shows an example).
        log_dir: where torchrun writes each rank's streams (:func:`log_args`); None: it writes none.
    """
    nproc = resolve_nproc(config)
    addr = config.master_addr or LOOPBACK
    port = config.master_port
    backend = config.rdzv_backend
    endpoint: str | None
    if not config.multi_node:  # rank 0's store binds here: a foreign address or a taken port fails now,
        check_listen_address(addr, port or 0)  # not after a minute of store retries
    if not config.multi_node and port is None and config.rdzv_endpoint is None:
        # No port given on one node: the c10d store binds port 0 itself, so no other process can
        # take the port between choosing it and binding it (what torchrun --standalone does).
        backend, endpoint = "c10d", f"{addr}:0"
    else:
        endpoint = config.rdzv_endpoint or (f"{addr}:{port or DEFAULT_PORT}" if backend == "c10d" else None)
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
        str(port or DEFAULT_PORT),
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
    # the agent forwards these to the workers; SIGUSR1 too: SLURM's warning before a pre-emption
    args += ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
    if not config.multi_node:
        args += ["--local-addr", addr]
    elif config.local_addr:
        args += ["--local-addr", config.local_addr]
    if log_dir is not None:
        args += log_args(config, log_dir)
    return [*args, "--module", ENTRY_MODULE, script, *script_args]


def log_args(config: LaunchConfig, log_dir: str) -> list[str]:
    """torchrun's own log options for ``--log-dir``, ``--tee`` and ``--local-ranks-filter``.

    Both streams of every rank go into files under ``log_dir``, and ``--tee`` picks the streams that also
    reach the console (default: both; each teed line starts with torchrun's ``[default<local_rank>]:``);
    ``--local-ranks-filter`` the ranks. Only when the user asked for one of them (:func:`logs_requested`):
    a file on a full disk would otherwise take the workers' errors off the console. torchrun's layout: ``LOG_DIR/<run id>_<random>/attempt_<k>/<local_rank>/{stdout,stderr}.log``.

    Example:
        >>> from multigpu.launcher.config import LaunchConfig
        >>> log_args(LaunchConfig(log_dir="/tmp/logs"), "/tmp/logs")
        ['--log-dir', '/tmp/logs', '--redirects', '3', '--tee', '3']
    """
    tee = STREAMS[config.tee] if config.tee is not None else STREAMS["both"]
    args = ["--log-dir", log_dir, "--redirects", str(STREAMS["both"]), "--tee", str(tee)]
    if config.local_ranks_filter is not None:
        args += ["--local-ranks-filter", ",".join(str(r) for r in config.local_ranks_filter)]
    return args


def run_torchrun(config: LaunchConfig, args: list[str], env: dict[str, str], script: str) -> int:
    """Run torchrun with ``args``, ``env`` added to the workers' environment; the launch's exit code.

    torch elastic's agent forwards SIGINT/SIGTERM/SIGHUP to the workers and kills them after its
    shutdown timeout, set here to ``config.grace_period_s``. When workers fail, the summary of
    :mod:`multigpu.launcher.root_cause` goes to stderr and the exit code is 1.
    """
    # whole seconds, read from this variable when the agent is configured
    env = {
        **env,
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(math.ceil(config.grace_period_s)),
    }
    # Imported here: torch.distributed.run pulls in the elastic agent, only needed for ddp.
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    # an outer launch's settings in this process's environment are not this launch's (environment.inherited)
    failure_dir = WorkerEnv.read(env, "failure_dir")
    with _environment(env, drop=WorkerEnv.variables()), _signal_handlers_restored(), _slow_ranks_told(failure_dir):
        try:
            run(parse_args(args))
        except (RendezvousError, DistError) as exc:  # before any worker ran: the nodes never met
            cause = f"{type(exc).__name__}: {exc}" + (f" ({exc.__cause__})" if exc.__cause__ else "")
            raise LaunchError(
                f"the rendezvous failed, so no worker started: {cause.splitlines()[0]} -- check that every node "
                "runs a launcher with the same --rdzv-endpoint or --master-addr/--master-port, that the address is "
                "reachable from every node, and (c10d) that one node hosts it (--rdzv-conf is_host=1 where the "
                "host name does not name that node)"
            ) from exc
        except (SignalException, KeyboardInterrupt) as exc:
            # the agent has already ended the workers (SIGKILL after the grace period)
            signum = exc.sigval if isinstance(exc, SignalException) else signal.SIGINT
            print(f"multigpu launch: stopped by {signal.Signals(signum).name}; workers ended", file=sys.stderr)
            return 128 + int(signum)
        except ChildFailedError as exc:
            # torch's own summary names the earliest error file by whole-second timestamp, often a
            # rank that failed only because the cause's rank exited: name the cause instead
            # and the agent reports only the ranks that had exited by then: add the workers' own records
            # (of the last attempt: the agent gives up once its restarts are spent)
            folder = WorkerEnv.read(env, "failure_dir")
            skipped: list[str] = []  # garbage in the run folder: named in the summary, never a crash or a hang
            recorded = failure_records.read(folder, attempt=config.max_restarts, skipped=skipped)
            finished = failure_records.read_finished(folder, attempt=config.max_restarts)
            failures = merge(from_torch(exc.failures), recorded, finished)
            found = evidence.read(folder, attempt=config.max_restarts, log_dir=_log_dir_of(args), skipped=skipped)
            print(format_summary(script, failures, found), file=sys.stderr, flush=True)
            return 1
    return 0


@contextmanager
def _slow_ranks_told(folder: str | None) -> Iterator[None]:
    """After the run (however it ends), the slow rank its main process reported, if any (:mod:`.slow_ranks`)."""
    try:
        yield
    finally:
        for line in slow_ranks.summary_lines(folder) if folder else []:
            print(line, file=sys.stderr, flush=True)


def _log_dir_of(args: Sequence[str]) -> str | None:
    ours = args[: args.index("--module")] if "--module" in args else args  # not the script's own arguments
    return ours[ours.index("--log-dir") + 1] if "--log-dir" in ours else None


@contextmanager
def _signal_handlers_restored() -> Iterator[None]:
    """Put this process's signal handlers back after torchrun (its agent installs its own and leaves
    them), so a library caller (the all-reduce probe, a test) keeps its Ctrl-C and SIGTERM behaviour."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")  # what torch elastic's agent handles
    main = threading.current_thread() is threading.main_thread()  # (only the main thread installs handlers)
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names if main and hasattr(signal, n))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


@contextmanager
def _environment(extra: dict[str, str], *, drop: Sequence[str] = ()) -> Iterator[None]:
    """Set ``extra`` in os.environ, less ``drop`` (torchrun hands its environment to the workers), then put the whole
    environment back: torch's launcher also sets variables in its caller's process
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``, ``OMP_NUM_THREADS``), which a library caller must not inherit."""
    saved = dict(os.environ)
    for name in drop:
        os.environ.pop(name, None)
    os.environ.update(extra)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
