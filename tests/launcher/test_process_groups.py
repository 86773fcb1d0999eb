"""The launcher's one terminator (``launcher/process_groups.py``): SIGTERM, a grace period, then SIGKILL to
the whole session, on real processes; bounded in time, nothing left."""

from __future__ import annotations

import signal
import time

import pytest

from multigpu.launcher.process_groups import end_sessions, exit_status, session_members
from tests.launching import alive, kill_tree, start_python

# a child that ignores SIGTERM and leaves two helpers that ignore it too: one in its process group, one in a
# group of its own within its session (as a DataLoader worker, and a helper that called setpgid, would)
_STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
helpers = []
for own_group in (False, True):
    pid = os.fork()
    if pid == 0:
        if own_group:
            os.setpgid(0, 0)
        time.sleep(300)
        os._exit(0)
    helpers.append(pid)
print(" ".join(map(str, helpers)), flush=True)
time.sleep(300)
"""

_POLITE = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
time.sleep(300)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_with_all_it_started() -> None:
    child = start_python("-c", _STUBBORN)
    try:
        assert child.stdout is not None
        helpers = [int(pid) for pid in child.stdout.readline().split()]
        assert len(helpers) == 2 and alive(helpers) == helpers
        started = time.monotonic()
        stubborn = end_sessions([child.pid], grace_s=1.0)
        took = time.monotonic() - started
        assert stubborn == [child.pid]  # it was still running when the grace ended
        assert 1.0 <= took < 8.0, took  # the grace, then the kill's bounded sweep
        assert exit_status(child.pid) == -signal.SIGKILL
        assert alive(helpers) == [] and session_members({child.pid}) == []
    finally:
        kill_tree(child)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_child_that_stops_on_sigterm_is_not_waited_for_the_whole_grace() -> None:
    child = start_python("-c", _POLITE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        started = time.monotonic()
        assert end_sessions([child.pid], grace_s=30.0) == []
        assert time.monotonic() - started < 10.0
        assert exit_status(child.pid) == 0  # its own exit, unreaped: the caller reaps it
        assert child.wait(timeout=5) == 0
    finally:
        kill_tree(child)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_pid_that_is_not_an_unreaped_child_is_never_signalled() -> None:
    """A leader the caller already reaped: its pid may name another process by now, which is not to be killed
    (here a process that is not this one's child at all stands for it)."""
    parent = start_python(
        "-c",
        "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(300)\nprint(pid, flush=True)\ntime.sleep(300)",
    )
    try:
        assert parent.stdout is not None
        stranger = int(parent.stdout.readline())
        assert end_sessions([stranger], grace_s=5.0) == []
        time.sleep(0.5)
        assert alive([stranger]) == [stranger]
    finally:
        kill_tree(parent)
