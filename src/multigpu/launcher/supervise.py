"""Run the one worker process of a ``single`` or ``dp`` launch, and never leave it behind.

``multigpu launch --strategy single|dp`` starts the script as a child process. Killing the
launcher (SIGTERM from a scheduler, SIGHUP from a closed terminal, Ctrl-C) must end the script
too; a plain ``subprocess.call`` left it running. :func:`run_supervised`:

- starts the child in a session (and process group) of its own, as torch elastic does with ddp
  workers, so a terminal's Ctrl-C reaches the launcher once and the launcher forwards it once;
- forwards SIGINT, SIGTERM, SIGHUP and SIGUSR1 to the child's process group (the script and anything it
  started, e.g. DataLoader workers);
- after the first forwarded signal, gives the child ``grace_s`` seconds to exit, then SIGKILLs its
  group, and once it has exited after a signal, whatever is left of its session
  (:func:`multigpu.launcher.process_groups.end_sessions`, the launcher's one terminator).

ddp launches get the same from torch elastic's agent (it handles SIGINT, SIGTERM, SIGHUP and
SIGQUIT, and kills its workers after its shutdown timeout, which ``multigpu launch`` sets to the
same grace period).

Example:
    >>> run_supervised([sys.executable, "-c", "pass"], dict(os.environ), grace_s=5.0)
    0
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from multigpu.launcher.process_groups import end_sessions, exit_status

# SIGUSR1: what SLURM sends before a pre-emption (sbatch --signal=USR1@120): the workers save and stop
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
_POLL_S = 0.1


def run_supervised(argv: Sequence[str], env: dict[str, str], *, grace_s: float) -> int:
    """Run ``argv`` to its end, forwarding termination signals; returns its exit code.

    Args:
        argv: the child's command line.
        env: its environment.
        grace_s: seconds the child gets after a forwarded signal before it is killed.

    Returns:
        The child's exit code; ``128 + N`` when it ended by signal ``N`` (as shells report it), or
        exited 0 after the forwarded signal ``N`` (a pre-emption it saved for),
        or when it was killed after ignoring the forwarded signal ``N`` for ``grace_s``.
    """
    received: list[int] = []
    started: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if started:
            _signal_group(started[0].pid, signum)

    # Handlers first: a signal between starting the child and installing them would end the
    # launcher alone. One that arrives before the child exists is sent to it once it does.
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        child = subprocess.Popen(list(argv), env=env, start_new_session=True)
    except BaseException:
        _restore(previous)
        raise
    started.append(child)
    for signum in received:
        _signal_group(child.pid, signum)
    try:
        return _wait(child.pid, received, grace_s)
    finally:
        _restore(previous)
        if received or exit_status(child.pid) is None:  # stopped by a signal (or by an error here): sweep the group
            end_sessions([child.pid], grace_s=0.0, first=None)
        child.wait()  # reaped only now: until here its pid named its group alone


def _wait(pid: int, received: list[int], grace_s: float) -> int:
    while (code := exit_status(pid)) is None and not received:
        time.sleep(_POLL_S)
    if code is None:  # a signal was forwarded: the grace period, then SIGKILL (process_groups.end_sessions)
        code = None if end_sessions([pid], grace_s=grace_s, first=None) else exit_status(pid)
        if code is None:  # still running when the grace ended (killed now)
            name = signal.Signals(received[0]).name
            print(
                f"multigpu launch: the script did not exit within {grace_s:g} s of {name}; killed it",
                file=sys.stderr,
                flush=True,
            )
            return 128 + received[0]
    if code == 0 and received:  # it saved and stopped on the signal: report the stop, as torchrun's agent does
        return 128 + received[0]
    return 128 - code if code < 0 else code


def _restore(previous: dict[signal.Signals, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group ``pid`` leads (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
