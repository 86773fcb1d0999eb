"""The failure named as the cause of a ddp run's end, chosen from real torch elastic error files."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from multigpu.errors import CollectiveTimeoutError, PeerExitedError
from multigpu.launcher.evidence import Evidence
from multigpu.launcher.root_cause import format_summary, from_torch, merge, root_cause
from multigpu.runtime import failure_records as records


def _error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, error: BaseException, *, mtime_ns: int
) -> str:
    """The error file torch elastic's @record writes for ``error`` (its real writer), dated ``mtime_ns``."""
    path = tmp_path / f"{name}.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise error
    except BaseException as exc:
        ErrorHandler().record_exception(exc)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return str(path)


def _failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errors: dict[int, tuple[BaseException, int]]
) -> dict[int, ProcessFailure]:
    """Global rank -> torch's ProcessFailure, read back from real error files (as the agent reads them)."""
    return {
        rank: ProcessFailure(
            local_rank=rank,
            pid=1000 + rank,
            exitcode=1,
            error_file=_error_file(tmp_path, monkeypatch, f"rank{rank}", error, mtime_ns=mtime_ns),
        )
        for rank, (error, mtime_ns) in errors.items()
    }


_SECOND = int(time.time()) * 1_000_000_000  # error files written within one second share this timestamp


@pytest.mark.parametrize("cause_rank", [0, 1, 3])
@pytest.mark.parametrize(
    "consequence",
    [
        PeerExitedError("lost a peer"),
        CollectiveTimeoutError("timed out"),
        RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242"),
    ],
)
def test_the_cause_is_named_even_when_a_consequence_shares_its_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cause_rank: int, consequence: BaseException
) -> None:
    errors = {rank: (consequence, _SECOND + 900_000_000) for rank in range(4)}
    errors[cause_rank] = (ValueError("rank broke on purpose"), _SECOND + 100_000_000)
    failures = _failures(tmp_path, monkeypatch, errors)
    if cause_rank:  # what torch picked: the lowest rank among equal whole-second timestamps
        assert ChildFailedError("train.py", failures).get_first_failure()[0] == 0
    cause = root_cause(from_torch(failures))
    assert (cause.rank, cause.message) == (cause_rank, "ValueError: rank broke on purpose")
    summary = format_summary("train.py", from_torch(failures))
    assert summary.startswith(f"multigpu launch: train.py failed on rank {cause_rank} (local_rank {cause_rank}")
    assert f"Traceback of rank {cause_rank}:" in summary and "raise error" in summary
    assert summary.count("exit code 1): " + type(consequence).__name__) == 3


def test_of_two_causes_the_earlier_wins_within_one_second(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failures = _failures(
        tmp_path,
        monkeypatch,
        {0: (KeyError("later"), _SECOND + 700_000_000), 1: (ValueError("first"), _SECOND + 200_000_000)},
    )
    assert root_cause(from_torch(failures)).rank == 1


def test_when_every_failure_is_a_consequence_the_summary_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failures = _failures(tmp_path, monkeypatch, {0: (CollectiveTimeoutError("reduce timed out"), _SECOND)})
    summary = format_summary("train.py", from_torch(failures))
    assert "failed on rank 0 (local_rank 0, exit code 1): CollectiveTimeoutError: reduce timed out" in summary
    assert "this rank lost a peer or timed out waiting for one" in summary


def test_a_worker_killed_by_a_signal_without_an_error_file_can_be_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failures = _failures(tmp_path, monkeypatch, {0: (PeerExitedError("lost a peer"), _SECOND)})
    failures[1] = ProcessFailure(local_rank=1, pid=1001, exitcode=-9, error_file=str(tmp_path / "none.json"))
    cause = root_cause(from_torch(failures))
    assert cause.rank == 1 and "SIGKILL" in cause.message
    assert "failed on rank 1 (local_rank 1, exit code -9): Signal 9 (SIGKILL)" in format_summary(
        "t.py", from_torch(failures)
    )


def test_a_worker_the_launcher_stopped_is_not_the_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 1 hung; rank 0 timed out; the agent then SIGTERMed rank 1 and listed it among the failures
    failures = _failures(tmp_path, monkeypatch, {0: (CollectiveTimeoutError("reduce timed out"), _SECOND)})
    failures[1] = ProcessFailure(local_rank=1, pid=1001, exitcode=-15, error_file=str(tmp_path / "none.json"))
    summary = format_summary("t.py", from_torch(failures))
    assert "failed on rank 0 (local_rank 0, exit code 1): CollectiveTimeoutError" in summary
    assert (
        "  rank 1 (local_rank 1, exit code -15): Signal 15 (SIGTERM) received by PID 1001 (stopped by the launcher)"
        in summary
    )


def _record_as(monkeypatch: pytest.MonkeyPatch, folder: Path, rank: int, error: BaseException) -> None:
    """``records.record(error)`` as a worker of rank ``rank`` under multigpu launch would call it."""
    monkeypatch.setenv("MULTIGPU_FAILURE_DIR", str(folder))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        raise error
    except BaseException as exc:
        records.record(exc)


def test_a_rank_the_agent_never_reported_is_named_from_its_own_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent saw only rank 0's consequence; rank 1 recorded its error before its group closed.
    reported = from_torch(_failures(tmp_path, monkeypatch, {0: (PeerExitedError("lost a peer"), _SECOND)}))
    _record_as(monkeypatch, tmp_path, 1, ValueError("the cause"))
    failures = merge(reported, records.read(tmp_path, attempt=0))
    assert root_cause(failures).rank == 1
    summary = format_summary("train.py", failures)
    assert "failed on rank 1 (local_rank 1, stopped by the launcher as it exited): ValueError: the cause" in summary
    assert "raise error" in summary  # its traceback, from the record
    assert "  rank 0 (local_rank 0, exit code 1): PeerExitedError: lost a peer" in summary


def test_a_record_replaces_what_the_agent_saw_of_a_rank_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stopped = ProcessFailure(local_rank=1, pid=1001, exitcode=-15, error_file=str(tmp_path / "missing.json"))
    reported = from_torch({**_failures(tmp_path, monkeypatch, {0: (PeerExitedError("lost"), _SECOND)}), 1: stopped})
    assert root_cause(reported).rank == 0  # without the record: only a consequence and a SIGTERM
    _record_as(monkeypatch, tmp_path, 1, ValueError("the cause"))
    cause = root_cause(merge(reported, records.read(tmp_path, attempt=0)))
    assert (cause.rank, cause.exitcode, cause.message) == (1, -15, "ValueError: the cause")


def test_only_a_workers_first_failure_and_only_the_asked_attempt_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _record_as(monkeypatch, tmp_path, 1, ValueError("first"))
    _record_as(monkeypatch, tmp_path, 1, PeerExitedError("its echo, while the group closed"))
    assert records.read(tmp_path, attempt=0)[1].message == "ValueError: first"
    assert records.read(tmp_path, attempt=1) == {}  # a restarted attempt does not see the last one's records
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _record_as(monkeypatch, tmp_path, 0, KeyError("second attempt"))
    assert set(records.read(tmp_path, attempt=1)) == {0}


def test_unreadable_records_are_skipped_and_recording_outside_a_launch_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "attempt-0-rank-0.json").write_text('{"rank": 0, "local_')  # cut short
    (tmp_path / "attempt-0-rank-1.json").write_text('{"rank": "one"}')
    assert records.read(tmp_path, attempt=0) == {}
    monkeypatch.delenv("MULTIGPU_FAILURE_DIR", raising=False)
    records.record(ValueError("not launched"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt-0-rank-0.json", "attempt-0-rank-1.json"]


def _signal_record(monkeypatch: pytest.MonkeyPatch, folder: Path, rank: int, signum: int) -> None:
    """``records.record_signal`` as the signal witness of a worker of rank ``rank`` calls it."""
    monkeypatch.setenv("MULTIGPU_FAILURE_DIR", str(folder))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "3")
    records.record_signal(signum)


def _stopped(rank: int) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=-15, error_file="/nonexistent/error.json")


def test_the_rank_a_signal_stopped_first_is_the_cause_and_the_rest_its_consequences(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kill -TERM of rank 1 alone; the agent then stopped ranks 0 and 2 with its own SIGTERM: all three -15
    _signal_record(monkeypatch, tmp_path, 1, signal.SIGTERM)
    _signal_record(monkeypatch, tmp_path, 0, signal.SIGTERM)
    _signal_record(monkeypatch, tmp_path, 2, signal.SIGTERM)
    failures = merge(from_torch({r: _stopped(r) for r in (0, 1, 2)}), records.read(tmp_path, attempt=0))
    assert root_cause(failures).rank == 1
    summary = format_summary("t.py", failures)
    assert summary.startswith(
        "multigpu launch: t.py failed on rank 1 (local_rank 1, exit code -15): stopped by SIGTERM: SIGTERM was not "
        "sent by the launcher"
    ), summary
    assert "  rank 0 (local_rank 0, exit code -15): stopped by SIGTERM (stopped by the launcher)" in summary
    assert "lost a peer or timed out" not in summary


def test_a_signal_after_another_ranks_error_or_timeout_is_the_launchers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for first in (ValueError("the cause"), CollectiveTimeoutError("reduce timed out")):
        folder = tmp_path / type(first).__name__
        folder.mkdir()
        _record_as(monkeypatch, folder, 1, first)  # the cause (world of 2 in _record_as: ranks 0 and 1)
        _signal_record(monkeypatch, folder, 2, signal.SIGTERM)  # the agent stopping the others, after
        _signal_record(monkeypatch, folder, 0, signal.SIGTERM)
        reported = from_torch({0: _stopped(0), 2: _stopped(2)})
        cause = root_cause(merge(reported, records.read(folder, attempt=0)))
        assert (cause.rank, cause.message) == (1, f"{type(first).__name__}: {first}")


def test_a_rank_that_lost_a_peer_on_another_node_before_the_signal_keeps_the_blame_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rank 2 failed on the other node; here rank 0 lost it as a peer, then the agent stopped rank 1
    _record_as(monkeypatch, tmp_path, 0, PeerExitedError("lost a peer"))
    _signal_record(monkeypatch, tmp_path, 1, signal.SIGTERM)
    failures = merge(from_torch({0: _stopped(0), 1: _stopped(1)}), records.read(tmp_path, attempt=0))
    assert root_cause(failures).rank == 0
    summary = format_summary("t.py", failures)
    assert "not sent by the launcher" not in summary
    assert "look at that node's launcher" in summary


@pytest.mark.parametrize("finished", [True, False])
def test_a_rank_that_aborts_after_its_script_returned_is_named_as_dying_at_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, finished: bool
) -> None:
    # rank 0's script returned, then a C++ thread aborted the process at exit; the agent SIGTERMed rank 1
    folder = tmp_path / "records"
    folder.mkdir()
    monkeypatch.setenv("MULTIGPU_FAILURE_DIR", str(folder))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    if finished:
        records.record_finished()
    none = str(tmp_path / "none.json")
    reported = {
        0: ProcessFailure(local_rank=0, pid=1000, exitcode=-6, error_file=none),
        1: ProcessFailure(local_rank=1, pid=1001, exitcode=-15, error_file=none),
    }
    done = records.read_finished(folder, attempt=0)
    assert done == ({0} if finished else set())
    failures = merge(from_torch(reported), records.read(folder, attempt=0), done)
    said = Evidence(stderr={0: "[fsdp x2] epoch 0: loss 2.15\nterminate called without an active exception\n"})
    summary = format_summary("train.py", failures, said)
    if finished:
        assert summary.startswith("multigpu launch: train.py finished on rank 0 (local_rank 0), then the process")
        assert "aborted at exit, after its script returned" in summary and "SIGABRT" in summary
        assert "terminate called without an active exception" in summary  # what it printed, still shown
        assert "issued differently" not in summary and "--debug" not in summary  # no collective to blame
    else:  # died during the script: the abort may well be a collective's, and the hint stays
        assert "failed on rank 0 (local_rank 0, exit code -6)" in summary and "issued differently" in summary
    assert "rank 1 (local_rank 1, exit code -15)" in summary and "(stopped by the launcher)" in summary
