"""Several Sessions one after the other in one launched process, each with a process group of its own.

The second of two ddp Sessions hung about one run in three (its rank read the first group's rendezvous
keys, which torch names the same for every group it creates after a destroy); eight Sessions in a row
met it in nearly every run before the fix (runtime/group_store.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launching import multigpu_launch

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("sequence_worker.py")
SESSIONS = ["ddp", "ddp", "ddp", "fsdp", "ddp", "fsdp", "ddp", "ddp"]


def test_sessions_one_after_the_other_each_join_and_close_their_group(tmp_path: Path) -> None:
    done = multigpu_launch(
        "--strategy", "fsdp", "--nproc-per-node", "2", str(WORKER), str(tmp_path), *SESSIONS, timeout_s=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["frozen"] > 10_000  # the entry froze torch's modules before the script (launcher/_entry.py)
        results = saved["sessions"]
        assert [r["strategy"] for r in results] == SESSIONS
        assert all(r["ranks"] == [1, 1] for r in results)
        assert all(r["weights"] == 4 for r in results)  # two Linear layers' weights and biases
        # the model the script dropped in a cycle is collected by the close, frozen objects or not
        assert [r["collected"] for r in results] == [True] * len(SESSIONS)
