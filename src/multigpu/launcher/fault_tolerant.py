"""``multigpu launch --fault-tolerant``: R replica groups that outlive each other, and the lighthouse they meet at.

    multigpu launch --strategy ddp --fault-tolerant --replicas 2 --nproc-per-node 1 --max-restarts 3 train.py

Each replica group is an ordinary ddp process group of ``--nproc-per-node`` processes with a store of
its own; the groups meet, in a quorum when one is due, at a torchft lighthouse that this launcher starts (on
several nodes, node 0's launcher starts it at ``--lighthouse HOST:PORT`` and the others are told the
same address). The workers average their gradients over the groups alive in each step
(:mod:`multigpu.runtime.replica_groups`).

This process supervises the groups: when a worker of a group dies, the group's other processes are
killed and the group is started again (up to ``--max-restarts`` times per group) on a fresh port; it
receives the current state live from a healthy group and rejoins. The others go on in the same
processes; a restart forks the group's workers from a warm zygote that has done their imports
(:mod:`multigpu.launcher.fault_tolerant_zygote`), or starts new interpreters when it cannot. The run
succeeds once a group has finished its script; it fails, naming every group and why, once every group
is dead with no restart left. A group is not restarted while the lighthouse does not accept a
connection (on another node than node 0, which holds it: node 0 was lost), as the restart could not
join. A signal to this process (a pre-emption) is forwarded to every worker and
ends the launch with ``128 + N`` once every group has stopped, restarting none; a stop signal that
reaches one worker alone is its group's loss (a script that leaves its loop at ``session.should_stop``
exits ``128 + N``, :mod:`multigpu.launcher._entry`).

The lighthouse's settings, chosen for a small job (:data:`LIGHTHOUSE`): a group whose heartbeat has
been silent for 1 s is dropped from the next quorum (the survivors wait about that long after a kill);
a quorum waits up to 5 s for a heartbeating group that has not joined yet; and ``min_replicas`` 1, so
that survivors go on alone, while the workers themselves refuse to start step 1 before all R groups
are in the quorum (a fresh run never starts alone).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from multigpu.errors import LaunchError
from multigpu.launcher.fault_tolerant_zygote import ForkedWorker, Zygote
from multigpu.launcher.process_groups import end_sessions
from multigpu.launcher.supervise import FORWARDED
from multigpu.launcher.torchrun import LOOPBACK
from multigpu.runtime.worker_env import WorkerEnv, WorkerRank

if TYPE_CHECKING:
    from multigpu.launcher.config import LaunchConfig

LIGHTHOUSE = {"heartbeat_timeout_ms": 1000, "join_timeout_ms": 5000, "quorum_tick_ms": 50, "min_replicas": 1}
_POLL_S = 0.05
# once one group has finished the script, how long the others get to finish theirs (they run in lockstep, so
# a healthy one is done within a step) before they are stopped: a group still restarting would wait forever
FINISH_GRACE_S = 10.0
# before restarting a group, how long the lighthouse gets to accept a connection: a group restarted without one
# would wait the whole quorum timeout for it (node 0, which holds it, was lost) and fail again
LIGHTHOUSE_PROBE_S = 3.0


def launch_fault_tolerant(
    config: LaunchConfig, script: str, script_args: Sequence[str], *, env: dict[str, str], nproc: int
) -> int:
    """Start the lighthouse (node 0, or one node) and this node's replica groups; the run's exit code."""
    assert config.replicas is not None
    nodes = int(config.nnodes.split(":")[-1])
    server = None
    if config.lighthouse is None:
        server, address = start_lighthouse("127.0.0.1:0", groups=config.replicas)
    elif config.node_rank == 0:
        server, _ = start_lighthouse(f"0.0.0.0:{config.lighthouse.rsplit(':', 1)[1]}", groups=config.replicas)
        address = f"http://{config.lighthouse}"
    else:
        address = f"http://{config.lighthouse}"
    # each group's ranks count from 0: binding by local rank would put every group on the same cores
    env = {key: value for key, value in env.items() if key != WorkerEnv.variable("bind_cores")}
    try:
        return run_groups(
            script=script,
            script_args=script_args,
            env={"RUST_LOG": "warn", **os.environ, **env},  # torchft's Rust side: no per-step quorum lines
            replicas=config.replicas,
            nproc=nproc,
            max_restarts=config.max_restarts,
            lighthouse=address,
            first_group=config.node_rank * config.replicas,
            total_groups=config.replicas * nodes,
            grace_s=config.grace_period_s,
        )
    finally:
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]


@dataclass
class Group:
    """One replica group: its processes, its restarts, and why it last stopped."""

    index: int
    processes: list[subprocess.Popen[bytes] | ForkedWorker] = field(default_factory=list)
    restarts: int = 0
    started_at: float = 0.0
    finished: bool = False
    dead_reason: str | None = None  # set once it is dead for good

    @property
    def running(self) -> bool:
        return bool(self.processes)


def start_lighthouse(bind: str, *, groups: int) -> tuple[object, str]:
    """Start the torchft lighthouse in this process; returns it and the address workers connect to."""
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft's Rust logger starts: no per-step quorum lines
    from torchft.coordination import LighthouseServer  # the optional extra: multigpu[fault-tolerant]

    del groups  # min_replicas stays 1: the workers hold step 1 until every group joined
    try:
        server = LighthouseServer(bind=bind, **LIGHTHOUSE)
    except RuntimeError as exc:  # torchft's Rust side: the port is taken, or the address is not this machine's
        raise LaunchError(
            f"cannot start the lighthouse at --lighthouse's port ({bind}): {exc}; pass a port free on node 0 "
            "(another launch's lighthouse may hold this one) to every node's launcher"
        ) from None
    port = server.address().rsplit(":", 1)[1]
    host = bind.rsplit(":", 1)[0]
    host = "127.0.0.1" if host in ("0.0.0.0", "[::]", "") else host
    return server, f"http://{host}:{port}"


def lighthouse_answers(address: str, within_s: float) -> bool:
    """Whether the lighthouse at ``address`` (``http://host:port``) accepts a connection within ``within_s``."""
    host, port = address.split("://", 1)[-1].rsplit(":", 1)
    deadline = time.monotonic() + within_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, within_s / 3)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (each group's store; a restarted group gets a fresh one)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def run_groups(
    *,
    script: str,
    script_args: Sequence[str],
    env: dict[str, str],
    replicas: int,
    nproc: int,
    max_restarts: int,
    lighthouse: str,
    first_group: int = 0,
    total_groups: int | None = None,
    grace_s: float = 30.0,
) -> int:
    """Run ``replicas`` groups of ``nproc`` workers until one finishes, restarting dead ones; the exit code.

    Args:
        env: every worker's environment (the launch's ``worker_env`` on top of this process's).
        first_group, total_groups: this node's first group index and the run's group count (several nodes).
        grace_s: after a signal reached the launcher (forwarded to every worker), how long the workers get
            to exit before they are killed.
    """
    total = total_groups or replicas
    groups = [Group(index=first_group + i) for i in range(replicas)]
    stopping: list[int] = []

    def forward(signum: int, frame: object) -> None:
        stopping.append(signum)
        for group in groups:
            _signal_group(group, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    zygote: Zygote | None = None
    try:
        for group in groups:
            _start(group, script, script_args, env, nproc, lighthouse, total, None)
        if max_restarts > 0:  # the warm spare restarts fork from, started after the groups it would slow down
            with contextlib.suppress(OSError):  # none (no pipe or process left): restarts start new interpreters
                zygote = Zygote(env)
        start = functools.partial(
            _start, script=script, args=script_args, env=env, nproc=nproc, lighthouse=lighthouse, total=total,
            zygote=zygote,
        )  # fmt: skip
        return _supervise(groups, start, zygote, script, max_restarts, stopping, grace_s, lighthouse)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for group in groups:
            _kill(group, zygote)
        if zygote is not None:
            zygote.close()


def _supervise(
    groups: list[Group],
    start: Callable[[Group], None],
    zygote: Zygote | None,
    script: str,
    max_restarts: int,
    stopping: list[int],
    grace_s: float,
    lighthouse: str,
) -> int:
    finished_at: float | None = None
    signalled_at: float | None = None
    while True:
        if stopping and signalled_at is None:
            signalled_at = time.monotonic()
        if signalled_at is not None and time.monotonic() - signalled_at > grace_s:
            name = signal.Signals(stopping[0]).name
            for group in groups:
                if group.running:
                    print(
                        f"multigpu launch: replica group {group.index} did not exit within {grace_s:g} s of {name}; "
                        "killing it",
                        file=sys.stderr,
                        flush=True,
                    )
                    _kill(group, zygote)
                    group.dead_reason = f"killed {grace_s:g} s after {name}"
        if finished_at is None and any(g.finished for g in groups):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > FINISH_GRACE_S:
            for group in groups:
                if group.running:
                    print(
                        f"multigpu launch: replica group {group.index} had not finished {FINISH_GRACE_S:g} s after "
                        "another group finished the script; stopping it (the finished group holds the result)",
                        file=sys.stderr,
                        flush=True,
                    )
                    _kill(group, zygote)
                    group.dead_reason = "stopped after another group finished"
        for group in groups:
            if not group.running:
                continue
            codes = [p.poll() for p in group.processes]
            if all(code == 0 for code in codes):
                _kill(group, zygote)  # reaps them (forked workers are the zygote's to reap), and what they left
                group.finished = True
                continue
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if not failed:
                continue
            rank, code = failed[0]
            reason = f"rank {rank} {_exit_text(code)}"  # type: ignore[arg-type]
            _kill(group, zygote)
            if stopping:  # the launcher's signal: the group's end, not a loss
                group.dead_reason = reason
                continue
            if any(g.finished for g in groups) or group.restarts >= max_restarts:
                group.dead_reason = reason + (f" (restarts used: {group.restarts} of {max_restarts})")
                continue
            if not lighthouse_answers(lighthouse, LIGHTHOUSE_PROBE_S):
                group.dead_reason = (
                    f"{reason}; not restarted: the lighthouse at {lighthouse} does not answer (its node, node 0, "
                    f"was lost?) (restarts used: {group.restarts} of {max_restarts})"
                )
                continue
            group.restarts += 1
            print(
                f"multigpu launch: replica group {group.index}: {reason}; restarting it "
                f"({group.restarts} of {max_restarts}); the other groups go on",
                file=sys.stderr,
                flush=True,
            )
            start(group)
        if not any(g.running for g in groups):
            break
        time.sleep(_POLL_S)
    if stopping:
        lines = [f"  replica group {g.index}: {'finished the script' if g.finished else g.dead_reason}" for g in groups]
        name = signal.Signals(stopping[0]).name
        print(
            f"multigpu launch: {name}: every replica group stopped:\n" + "\n".join(lines), file=sys.stderr, flush=True
        )
        return 128 + stopping[0]
    if any(g.finished for g in groups):
        return 0
    lines = [f"  replica group {g.index}: {g.dead_reason}" for g in groups]
    print(
        f"multigpu launch: every replica group of {script} is dead and no restart is left:\n" + "\n".join(lines),
        file=sys.stderr,
        flush=True,
    )
    return 1


def _start(
    group: Group,
    script: str,
    args: Sequence[str],
    env: dict[str, str],
    nproc: int,
    lighthouse: str,
    total: int,
    zygote: Zygote | None,
) -> None:
    """Start the group's workers: a restart forks them from the zygote when it can serve, else new interpreters."""
    port = free_port()
    group.started_at = time.monotonic()
    group.processes = []
    for rank in range(nproc):
        worker = {
            **env,
            **WorkerRank(
                rank=rank,
                local_rank=rank,
                world_size=nproc,
                local_world_size=nproc,
                master_addr=LOOPBACK,
                master_port=port,
                restarts=group.restarts,
            ).to_environ(),
            WorkerEnv.variable("replica_group"): str(group.index),
            WorkerEnv.variable("replica_groups"): str(total),
            WorkerEnv.variable("lighthouse"): lighthouse,
        }
        forked = zygote.start_worker(worker, [script, *args]) if zygote is not None and group.restarts > 0 else None
        if forked is not None:
            group.processes.append(forked)
            continue
        argv = [sys.executable, "-m", "multigpu.launcher._entry", script, *args]
        worker[WorkerEnv.variable("supervisor")] = str(os.getpid())  # it dies with this process (a lost node)
        group.processes.append(subprocess.Popen(argv, env=worker, start_new_session=True))


def _signal_group(group: Group, signum: int) -> None:
    for process in group.processes:
        if process.returncode is None:  # a reaped worker's pid (its group's id) may name another process by now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)


def _kill(group: Group, zygote: Zygote | None) -> None:
    """SIGKILL the group's workers and everything they started (the launcher's one terminator), then reap them."""
    spawned = [p for p in group.processes if isinstance(p, subprocess.Popen)]
    end_sessions([p.pid for p in spawned if p.returncode is None], grace_s=0.0, first=None)
    for process in spawned:
        process.wait()
    forked = [p for p in group.processes if isinstance(p, ForkedWorker)]
    if forked and zygote is not None:
        zygote.end(forked)  # they are the zygote's children: it kills what is left of their sessions and reaps them
    group.processes = []


def _exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code - 128 in (signal.SIGTERM, signal.SIGUSR1):  # the entry point's code for a script that stopped at it
        return f"left its loop at {signal.Signals(code - 128).name} (session.should_stop; exit code {code})"
    return f"exited with code {code}"
