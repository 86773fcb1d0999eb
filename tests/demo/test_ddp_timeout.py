"""The demo's DDP run past its timeout ends its launch and the launch's workers (real gloo processes).

The workers run in sessions of their own (torch elastic starts them so): killing the launcher alone, as
``subprocess.run(timeout=...)`` did, left them training. They are found here by the run's folder in
their command line (a folder of this test's own).
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
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


@pytest.mark.multiprocess
def test_a_demo_run_past_its_timeout_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the run's folder, named in its workers' argv
    try:
        with pytest.raises(LaunchError, match="took longer than timeout_s=30; raise it"):
            run_ddp(TrainConfig(epochs=100_000), nproc_per_node=2, timeout_s=30)
        deadline = time.monotonic() + 5
        while _ours(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _ours(tmp_path) == [], "the launch's workers outlived the demo's timeout"
    finally:
        for pid in _ours(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
