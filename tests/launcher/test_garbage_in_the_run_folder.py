"""Garbage in the run folder: the launcher's summary still comes, at once, and names each file it left out.

Every file a worker writes for the launcher (failure record, ledger, snapshot of the ledgers, stack dump,
stderr copy, torchrun's stderr log) is replaced in turn by a real hostile file: a FIFO, a link to
/dev/zero, a sparse file of gigabytes, bytes that are not UTF-8, JSON nested deep, 1e999, a list where a
mapping belongs, a folder. The summary is built the way the launcher builds it (the readers, then
:func:`format_summary`), in bounded time; the healthy files still tell the story; a record-like file that
is garbage is named. Last, a real ``multigpu launch`` whose worker plants garbage before it fails.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from multigpu.launcher import allreduce_probe, evidence, measure
from multigpu.launcher.root_cause import format_summary, merge
from multigpu.runtime import failure_records
from tests.core.test_run_files import KINDS, hostile, within
from tests.launching import multigpu_launch

FILES = {
    "record": "attempt-0-rank-3.json",
    "ledger": "attempt-0-rank-1.ledger",
    "snapshot": "attempt-0-snapshot-by-rank-0.json",
    "stacks": "attempt-0-rank-1.stacks",
    "stderr": "attempt-0-rank-1.stderr",
    "log": "logs/run/attempt_0/1/stderr.log",
}
TEXT_FILES = {"stacks", "stderr", "log"}  # read as text: only what is not a regular file is garbage there


def _ledger(folder: Path, rank: int, seq: int) -> None:
    entry = {"rank": rank, "pid": 4242, "start": 7, "main_thread": 1, "seq": seq, "operation": "barrier"}
    text = json.dumps({**entry, "site": "train.py:9", "since": time.time()})
    (folder / f"attempt-0-rank-{rank}.ledger").write_text(text.ljust(1023) + "\n")


def _healthy_run(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 timed out in collective #2 (its own record), rank 1 never came (its ledger is at #1)."""
    monkeypatch.setenv("MULTIGPU_FAILURE_DIR", str(folder))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    failure_records.record(TimeoutError("stand-in"))  # replaced below: the message is what the summary reads
    record = folder / "attempt-0-rank-0.json"
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "message": "CollectiveTimeoutError: timed out waiting for rank 1"}))
    _ledger(folder, 0, 2)
    _ledger(folder, 1, 1)
    (folder / "logs/run/attempt_0/1").mkdir(parents=True)


def _summary(folder: Path) -> str:
    """What the launcher prints, read the way it reads it (runtime's records, the evidence, the summary)."""
    skipped: list[str] = []
    recorded = failure_records.read(folder, attempt=0, skipped=skipped)
    found = evidence.read(folder, attempt=0, log_dir=folder / "logs", skipped=skipped)
    return format_summary("train.py", merge([], recorded), found)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", list(FILES))
def test_a_hostile_file_in_the_run_folder_is_named_and_the_summary_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str, kind: str
) -> None:
    _healthy_run(tmp_path, monkeypatch)
    path = tmp_path / FILES[which]
    path.unlink(missing_ok=True)
    hostile(kind, path)
    summary = within(10, lambda: _summary(tmp_path))
    assert "train.py" in summary.splitlines()[0]
    garbage = which not in TEXT_FILES or kind in ("fifo", "dev-zero", "folder")
    named = [line for line in summary.splitlines() if line.strip().startswith(f"{path}: ")]
    assert bool(named) == garbage, summary
    if garbage:
        assert "Unreadable records left out of this summary" in summary
    if which != "ledger":  # the ledgers say rank 1 never reached collective #2
        assert "rank 1 never reached collective #2, barrier at train.py:9" in summary, summary


def test_many_unreadable_files_are_counted_past_the_first_ten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _healthy_run(tmp_path, monkeypatch)
    for rank in range(10, 110):
        (tmp_path / f"attempt-0-rank-{rank}.json").write_text("[]")
    lines = within(10, lambda: _summary(tmp_path)).splitlines()
    named = [line for line in lines if line.startswith(f"  {tmp_path}/attempt-0-rank-")]
    assert len(named) == 10 and lines[-1] == "  ... and 90 more", lines[-12:]


@pytest.mark.parametrize(
    "entry",
    [
        {"since": 1e300},  # finite, but no clock reads it: time.localtime() overflowed
        {"seq": "1"},
        {"pid": [4242]},
        {"main_thread": None},
        {"rank": -2},
    ],
)
def test_a_ledger_of_the_right_shape_but_impossible_values_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: dict[str, object]
) -> None:
    _healthy_run(tmp_path, monkeypatch)
    ledger = tmp_path / "attempt-0-rank-1.ledger"
    ledger.write_text(json.dumps({**json.loads(ledger.read_text()), **entry}))
    summary = within(10, lambda: _summary(tmp_path))
    assert f"  {ledger}: its " in summary, summary


def test_a_stack_dump_with_absurd_numbers_or_lines_still_gives_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _healthy_run(tmp_path, monkeypatch)
    stacks = tmp_path / "attempt-0-rank-1.stacks"
    stacks.write_text(
        "Thread 0x0000000000000001 (most recent call first):\n"
        f'  File "/w/train.py", line {"9" * 5000} in stuck\n'
        '  File "/w/train.py", line 12 in main\n'
    )
    err = tmp_path / "attempt-0-rank-1.stderr"
    err.write_text("ProcessGroup" * 1400 + "\n")  # a line a backtracking pattern takes minutes over
    summary = within(10, lambda: _summary(tmp_path))
    assert "rank 1 was at train.py:12 in main" in summary, summary


@pytest.mark.multiprocess
def test_a_launch_whose_worker_planted_garbage_still_names_the_cause(tmp_path: Path) -> None:
    script = tmp_path / "plants_garbage.py"
    script.write_text(
        "import os\n"
        "folder = os.environ['MULTIGPU_FAILURE_DIR']\n"
        "os.mkfifo(os.path.join(folder, 'attempt-0-rank-7.json'))\n"
        "os.symlink('/dev/zero', os.path.join(folder, 'attempt-0-rank-8.json'))\n"
        "with open(os.path.join(folder, 'attempt-0-rank-9.json'), 'w') as f:\n"
        '    f.write(\'{"rank": 1e999, "local_rank": 0, "message": "x", "traceback": "", "when_ns": 1e999}\')\n'
        "raise ValueError('the real cause')\n"
    )
    done = multigpu_launch("--strategy", "ddp", "--nproc-per-node", "1", str(script), timeout_s=120)
    assert done.returncode == 1, done.stderr[-3000:]
    summary = done.stderr[done.stderr.rindex("multigpu launch: ") :]
    assert "failed on rank 0" in summary and "ValueError: the real cause" in summary, summary
    for name, why in [("7", "named pipe"), ("8", "character device"), ("9", "1e999 is not finite")]:
        assert f"attempt-0-rank-{name}.json: " in summary and why in summary, summary


# -- the measuring commands read their workers' reports the same way --------------------------------------


_REPORT = {"rank": 0, "step_s": [0.1, 0.3], "samples": [8, 8], "peak_bytes": [1]}


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_measurement_report_fails_the_run_by_name(tmp_path: Path, kind: str) -> None:
    (tmp_path / "rank0.json").write_text(json.dumps(_REPORT))
    path = hostile(kind, tmp_path / "rank1.json")
    hostile(kind, tmp_path / "output.txt") if kind in ("fifo", "dev-zero", "huge") else None
    run = measure.MeasureRun(strategy="ddp", devices=2)
    found = within(10, lambda: measure._outcome(run, 1.0, 0, tmp_path))
    assert (found.status, found.reason.split(": ")[0]) == ("failed", f"unreadable report {path}"), found


@pytest.mark.parametrize(
    "report", [{"step_s": "fast"}, {"samples": [None, 1]}, {"peak_bytes": {"a": 1}}, {"step_s": None}]
)
def test_a_measurement_report_of_another_shape_fails_the_run(tmp_path: Path, report: dict[str, object]) -> None:
    (tmp_path / "rank0.json").write_text(json.dumps({**_REPORT, **report}))
    found = measure._outcome(measure.MeasureRun(strategy="single", devices=1), 1.0, 0, tmp_path)
    assert found.status == "failed" and found.reason.startswith("a worker's report is not what it writes"), found


def test_a_sound_measurement_report_is_combined(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text(json.dumps(_REPORT))
    found = measure._outcome(measure.MeasureRun(strategy="single", devices=1), 1.0, 0, tmp_path)
    # the step reported is the low quantile of the timed steps (multigpu.planning.timing), not their median (0.2)
    assert found.status == "ok" and found.step_s == pytest.approx(0.1), found


@pytest.mark.parametrize("kind", [*KINDS, "strings", "short"])
def test_a_hostile_all_reduce_timing_file_names_itself(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "rank1.json"
    if kind == "strings":
        path.write_text('["0.1", "0.2"]')
    elif kind == "short":
        path.write_text("[0.1]")
    else:
        hostile(kind, path)
    with pytest.raises(RuntimeError, match=f"all-reduce probe: {path}: .*rerun the probe"):
        within(10, lambda: allreduce_probe._seconds(path, 2))
    path.unlink() if not path.is_dir() else path.rmdir()
    path.write_text("[0.1, 2]")
    assert allreduce_probe._seconds(path, 2) == [0.1, 2.0]
