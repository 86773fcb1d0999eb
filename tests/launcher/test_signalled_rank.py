"""A signal sent to one rank only (``kill -TERM`` / ``kill -KILL`` of rank 1's pid) while rank 0 waits in a
collective: the launcher's summary blames the rank the signal stopped, names the signal, and calls the
waiting rank's failure a consequence (real gloo workers under ``multigpu launch``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.launching import kill_tree, read_lines_until, start_launch

pytestmark = pytest.mark.multiprocess

_LONG = os.environ.get("MULTIGPU_LONG") == "1"
_WORKER = """
import os, time
import torch
from multigpu.session import Session
with Session(strategy="ddp") as session:
    session.barrier()
    os.write(1, f"ready {session.global_rank} {os.getpid()}\\n".encode())
    if session.global_rank == 0:
        session.reduce(torch.ones(1))  # waits here for rank 1, which never comes
    else:
        time.sleep(120)
"""


@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGTERM,
        pytest.param(signal.SIGKILL, marks=pytest.mark.skipif(not _LONG, reason="MULTIGPU_LONG=1: the SIGKILL case")),
    ],
)
def test_a_signal_to_one_rank_blames_that_rank(tmp_path: Path, sig: signal.Signals) -> None:
    script = tmp_path / "waits.py"
    script.write_text(_WORKER)
    launcher = start_launch("--strategy", "ddp", "--nproc-per-node", "2", "--grace-period", "2", str(script))
    try:
        ready = read_lines_until(launcher, "ready ", 2, timeout_s=90)
        pids = {int(line.split()[1]): int(line.split()[2]) for line in ready}
        time.sleep(0.5)  # rank 0 is in its reduce by now
        os.kill(pids[1], sig)
        code = launcher.wait(timeout=60)
        stderr = launcher.stderr.read() if launcher.stderr else ""
    finally:
        kill_tree(launcher)
    assert code == 1, stderr
    summary = stderr[stderr.rindex("multigpu launch: ") :]
    lead = summary.splitlines()[0]
    assert lead.startswith(f"multigpu launch: {script} failed on rank 1 (local_rank 1, "), summary
    assert f"{sig.name} was not sent by the launcher" in lead, summary
    assert f"exit code -{int(sig)})" in lead, summary  # it still died of the signal, as it would have unwatched
    consequences = summary[summary.index("Other ranks that failed") :]
    assert "rank 0 (local_rank 0" in consequences, summary
    assert "lost a peer or timed out" not in summary, summary  # the cause is known: no guess about it
