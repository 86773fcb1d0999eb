"""End what a launcher started, and everything that started: the one terminator with a grace period.

Every child a launcher starts leads a session (and process group) of its own: the one process of a
``single``/``dp`` launch (:mod:`multigpu.launcher.supervise`), the forked ranks of ``launch_function``
(:mod:`multigpu.launcher._forked_ranks`), the runs of ``advise --measure``
(:mod:`multigpu.launcher.measure`), ``scontrol`` (:mod:`multigpu.launcher.preemption`). :func:`end_sessions`
ends them the same way:

1. ``SIGTERM`` (or the signal given) to each leader and its group, unless the caller has already sent one;
2. up to ``grace_s`` seconds for the leaders to exit (a script saving its checkpoint on the signal);
3. ``SIGKILL`` to each group and to every process still in one of the sessions (a helper that made a process
   group of its own within it), repeated until none is left, for a bounded time.

The leaders are waited for without being reaped (``waitid`` with ``WNOWAIT``), so a leader's pid, the id
of its session and group, cannot be taken by another process before its group has been killed; the caller
reaps them (``Popen.wait``, ``Process.join``).

Example:
    >>> child = subprocess.Popen(["sleep", "60"], start_new_session=True)  # doctest: +SKIP
    >>> end_sessions([child.pid], grace_s=5.0)  # doctest: +SKIP
    [...]
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

_SWEEP_S = 5.0  # after SIGKILL: how long the sweep waits for the kernel to end what it signalled
_POLL_S = 0.02


def end_sessions(leaders: Sequence[int], *, grace_s: float, first: int | None = signal.SIGTERM) -> list[int]:
    """Stop the sessions ``leaders`` lead: ``first``, ``grace_s`` seconds, then SIGKILL to all that is left.

    Args:
        leaders: pids of this process's children, each the leader of its own session and process group.
        grace_s: how long the leaders get to exit after ``first`` (0: kill at once).
        first: the signal that asks them to stop; None when the caller already sent it (a forwarded one).

    Returns:
        The leaders that were still running when the grace period ended (they were killed).
    """
    # a leader already reaped is left alone: its pid may name another process by now
    leaders = [pid for pid in leaders if _unreaped_child(pid)]
    if first is not None:
        for pid in leaders:
            if exit_status(pid) is None:
                _signal(pid, first)
    _wait_until(lambda: all(exit_status(pid) is not None for pid in leaders), grace_s)
    stubborn = [pid for pid in leaders if exit_status(pid) is None]
    for pid in leaders:
        _signal(pid, signal.SIGKILL)  # the group too: what the leader started, even when it has exited

    def nothing_left() -> bool:
        left = session_members(set(leaders))
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return not left and all(exit_status(pid) is not None for pid in leaders)

    _wait_until(nothing_left, _SWEEP_S)
    return stubborn


def exit_status(pid: int) -> int | None:
    """A child's exit code (negative: the signal that ended it), None while it runs; the child is left unreaped.

    A child already reaped (by ``Popen.poll``) has ended: 0 is returned for it, its code is the caller's to know.
    """
    if not hasattr(os, "waitid"):  # (macOS before Python 3.13): whether it still exists is all one can ask
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return 0
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already
        return 0
    if info is None or info.si_pid == 0:
        return None
    return int(info.si_status) if info.si_code == os.CLD_EXITED else -int(info.si_status)


def _unreaped_child(pid: int) -> bool:
    if not hasattr(os, "waitid"):
        return True  # (macOS before Python 3.13) no way to ask without reaping: the caller's word
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def session_members(sessions: set[int]) -> list[int]:
    """The running processes (zombies excluded) whose session or process group is one of ``sessions``
    (Linux's /proc; elsewhere none are found, and the groups' SIGKILL is what ends them)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
            if len(fields) > 3 and fields[0] != "Z" and (int(fields[2]) in sessions or int(fields[3]) in sessions):
                found.append(int(entry.name))
    return found


def _wait_until(done: Callable[[], bool], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not done() and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def _signal(pid: int, signum: int) -> None:
    """``signum`` to the child and to its process group (a forked child may not have made its group yet)."""
    for send in (os.kill, os.killpg):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            send(pid, signum)
