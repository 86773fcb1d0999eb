"""A worker writes into the run folder without trusting what is already there.

A FIFO where a worker writes its failure record's partial file, its stack file or its stderr copy would
block the worker (an ``open`` for writing waits for a reader); a link where its ledger goes would have
the worker truncate the link's target. Each is met here on real files: the worker goes on, in bounded
time, and writes nothing through the link.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from multigpu.launcher import _entry
from multigpu.runtime import failure_records, tracking
from tests.core.test_run_files import within
from tests.runtime.launched_rank import launched_as


@pytest.fixture
def launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process as rank 0 of 2 under ``multigpu launch`` (its failure folder), with a fresh ledger."""
    yield from launched_as(0, tmp_path, monkeypatch)


def test_a_fifo_at_the_record_s_partial_name_neither_blocks_nor_stops_the_record(launched: Path) -> None:
    partial = f"attempt-0-rank-0.json.{os.getpid()}.{threading.get_ident()}.tmp"  # this thread's, as it is now
    for name in (partial, f"attempt-0-rank-0.json.{os.getpid()}.tmp", f"attempt-0-rank-0.{os.getpid()}.tmp"):
        os.mkfifo(launched / name)
    within(10, lambda: failure_records.record(ValueError("broke")))
    assert failure_records.read(launched, attempt=0)[0].message == "ValueError: broke"


def test_a_fifo_at_the_snapshot_s_partial_name_does_not_block_the_rank_that_timed_out(launched: Path) -> None:
    partial = f"attempt-0-snapshot-by-rank-0.json.{os.getpid()}.{threading.get_ident()}.tmp"
    for name in (partial, f"attempt-0-snapshot-by-rank-0.json.{os.getpid()}.tmp", "attempt-0-snapshot-by-rank-0.tmp"):
        os.mkfifo(launched / name)  # the partial's name now, and the one every rank 0 used before
    tracking._ledger._open()
    within(10, lambda: tracking.request_peer_stacks(wait_s=0.1))
    assert set(tracking.read_snapshot(launched, attempt=0)) == {0}


def test_a_fifo_at_the_stack_file_leaves_the_worker_starting(launched: Path) -> None:
    os.mkfifo(launched / "attempt-0-rank-0.stacks")
    within(10, tracking.setup_worker)
    assert tracking._stack_file is None  # no stacks on request, but the worker runs


def test_a_link_at_the_ledger_s_name_is_not_written_through(
    launched: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    precious = tmp_path_factory.mktemp("elsewhere") / "precious.txt"
    precious.write_text("keep me")
    (launched / "attempt-0-rank-0.ledger").symlink_to(precious)
    tracking.enter("barrier")
    assert precious.read_text() == "keep me"
    assert tracking.read_ledgers(launched, attempt=0) == {}


def test_a_fifo_at_the_stderr_copy_leaves_stderr_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "attempt-0-rank-0.stderr"
    os.mkfifo(path)
    before = os.fstat(2)
    within(10, lambda: _entry._copy_stderr(path))
    after = os.fstat(2)
    assert (before.st_ino, before.st_dev) == (after.st_ino, after.st_dev)
