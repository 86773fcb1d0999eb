"""A launcher stopped by SIGINT, SIGTERM or SIGHUP ends every worker within the grace period: none is left, by PID."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.launching import alive, descendants, kill_tree, read_lines_until, start_launch

pytestmark = pytest.mark.multiprocess

_WORKER = """
import os, signal, sys, time
from multigpu.session import Session
if sys.argv[1] == "stubborn":  # a script that ignores the signals: only the grace period's SIGKILL ends it
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
with Session() as session:
    session.barrier()
    os.write(1, f"ready {os.getpid()}\\n".encode())  # one write: print's pieces interleave between workers
    time.sleep(300)
"""
_MODES = {
    "single": ["--strategy", "single"],
    "dp": ["--strategy", "dp", "--devices", "cpu:2"],
    "ddp": ["--strategy", "ddp", "--nproc-per-node", "2"],
}


@pytest.mark.parametrize(
    ("mode", "sig", "behaviour"),
    [
        ("single", signal.SIGTERM, "obeys"),  # the worker ran on, 40 s and more, after the launcher died
        ("single", signal.SIGINT, "obeys"),
        ("dp", signal.SIGHUP, "stubborn"),
        ("ddp", signal.SIGHUP, "stubborn"),  # torch elastic's agent forwards; the grace period is its timeout
    ],
)
def test_a_stopped_launcher_leaves_no_worker(tmp_path: Path, mode: str, sig: signal.Signals, behaviour: str) -> None:
    script = tmp_path / "sleeps.py"
    script.write_text(_WORKER)
    workers = 2 if mode == "ddp" else 1
    grace = 2.0
    launcher = start_launch(*_MODES[mode], "--grace-period", str(grace), str(script), behaviour)
    try:
        ready = read_lines_until(launcher, "ready ", workers, timeout_s=90)
        pids = sorted({int(line.split()[1]) for line in ready} | set(descendants(launcher.pid)))
        assert len(pids) >= workers
        began = time.monotonic()
        launcher.send_signal(sig)
        code = launcher.wait(timeout=60)
        took = time.monotonic() - began
        left = alive(pids)
    finally:
        kill_tree(launcher)
    assert left == [], f"{mode}: workers {left} still run after the launcher got {sig.name}"
    assert code == 128 + sig, launcher.stderr.read() if launcher.stderr else ""
    if behaviour == "stubborn":
        # ended by the grace period's SIGKILL: after it, not long after (the bound is generous: a shared machine)
        assert grace <= took < grace + 30
