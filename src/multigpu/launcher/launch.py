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
  freed buffers, :meth:`~multigpu.devices.cpu.CpuDevice.sharded_process_env`), with the rest of what
  every worker is told, built once for every launch path (:func:`multigpu.launcher.environment.worker_env`);
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

from multigpu.devices import parse_devices
from multigpu.errors import ConfigError, LaunchError
from multigpu.launcher.config import LaunchConfig, logs_requested
from multigpu.launcher.environment import inherited, users_run_token, worker_env
from multigpu.launcher.fault_tolerant import launch_fault_tolerant
from multigpu.launcher.preemption import maybe_requeue
from multigpu.launcher.preflight import check_log_dir
from multigpu.launcher.supervise import run_supervised
from multigpu.launcher.torchrun import build_torchrun_args, resolve_nproc, run_torchrun
from multigpu.runtime.scheduler_world import DEFAULT_PORT
from multigpu.strategies import STRATEGIES
from multigpu.strategies.registry import launched_auto

__all__ = ["LaunchConfig", "check_ranks_filter", "launch", "resolve_strategy", "waiting_message", "worker_env"]


def resolve_strategy(config: LaunchConfig, nproc: int) -> str:
    """``auto`` becomes ``ddp`` for several processes and ``single`` for one."""
    if config.strategy != "auto":
        return config.strategy
    return launched_auto(nproc, multi_node=config.multi_node)


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
    token = users_run_token()  # the user's MULTIGPU_RUN_ID joins this launch to that run; else worker_env makes one
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
        env = {**inherited(os.environ), **worker_env(config, strategy, 1, run_token=token)}
        code = run_supervised([sys.executable, script, *script_args], env, grace_s=config.grace_period_s)
        return maybe_requeue(config, code)
    if config.log_dir is not None:
        check_log_dir(config.log_dir)  # torchrun's own traceback otherwise, after the rendezvous
    if config.fault_tolerant:
        # the node's cores are shared by every group's processes (OMP_NUM_THREADS)
        env = worker_env(config, strategy, nproc * (config.replicas or 1), run_token=token)
        return maybe_requeue(config, launch_fault_tolerant(config, script, script_args, env=env, nproc=nproc))
    with tempfile.TemporaryDirectory(prefix="multigpu-failures-") as failure_dir:
        log_dir = (config.log_dir or os.path.join(failure_dir, "logs")) if logs_requested(config) else None
        args = build_torchrun_args(config, script, script_args, log_dir=log_dir)
        if config.multi_node:  # the rendezvous waits silently for the other nodes: say where and for whom
            print(f"multigpu launch: {waiting_message(config, nproc)}", file=sys.stderr, flush=True)
        env = worker_env(config, strategy, nproc, failure_dir=failure_dir, run_token=token)
        return maybe_requeue(config, run_torchrun(config, args, env, script))


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
