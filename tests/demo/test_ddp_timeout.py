"""The demo's DDP run past its timeout ends its launch and the launch's workers (real gloo processes).

The workers run in sessions of their own (torch elastic starts them so): killing the launcher alone, as
``subprocess.run(timeout=...)`` did, left them training. They are found here by the run's folder in
their command line (a folder of this test's own). The demo's timeout starts short and doubles only when no
worker had started by then (nothing to check): a fixed 30 s, long enough for the worst load, was waited out
in every run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from multigpu.demo.ddp import run_ddp
from multigpu.demo.train import TrainConfig
from multigpu.errors import LaunchError
from tests.launching import alive


def _ours(folder: Path) -> list[int]:
    """The running processes whose command line names ``folder``."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and str(folder).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return alive(found)


_TIMEOUTS_S = (8, 16, 32)


def _workers_seen(folder: Path, stop: threading.Event, seen: list[int]) -> None:
    """Note the launch's workers (ranks run through the launcher's entry module) until ``stop`` is set."""
    while not stop.wait(0.1):
        for pid in _ours(folder):
            with contextlib.suppress(OSError):
                if b"multigpu.launcher._entry" in Path(f"/proc/{pid}/cmdline").read_bytes() and pid not in seen:
                    seen.append(pid)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_demo_run_past_its_timeout_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the run's folder, named in its workers' argv
    seen: list[int] = []
    try:
        for timeout_s in _TIMEOUTS_S:
            seen.clear()  # this launch's workers
            stop = threading.Event()
            watcher = threading.Thread(target=_workers_seen, args=(tmp_path, stop, seen))
            watcher.start()
            try:
                with pytest.raises(LaunchError, match=f"took longer than timeout_s={timeout_s}; raise it"):
                    run_ddp(TrainConfig(epochs=100_000), nproc_per_node=2, timeout_s=timeout_s)
            finally:
                stop.set()
                watcher.join()
            deadline = time.monotonic() + 5
            while _ours(tmp_path) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _ours(tmp_path) == [], "the launch's workers outlived the demo's timeout"
            if len(seen) == 2:
                break
        assert len(seen) == 2, f"the two workers never started within {timeout_s} s: nothing was checked"
    finally:
        for pid in _ours(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
