"""A rank asks its peers for their stacks by signal: only a process that proves to be that rank's worker of this run.

Real processes: a bystander the test starts (``sleep``; the stack signal's default action would end it)
named by a stale or forged ledger must not receive it; a real worker of the run (its ledger written by
``tracking.setup_worker``) must, and writes its stack. Ledgers naming pid 0, -1, a negative number, a
huge number or something not an integer are refused when read, and nothing is signalled.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from multigpu.launcher import measure
from multigpu.runtime import peers, tracking
from tests.launching import finished_pid, kill_tree, read_lines_until, start_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the proof reads /proc (Linux)")

_SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"


@pytest.fixture
def launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process as rank 1 of 2 under ``multigpu launch`` (its failure folder); it records any stack signal."""
    folder = tmp_path / "run"
    folder.mkdir()
    monkeypatch.setenv("MULTIGPU_FAILURE_DIR", str(folder))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    received: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = signal.signal(tracking.STACK_SIGNAL, note)
    yield folder
    signal.signal(tracking.STACK_SIGNAL, previous)
    assert received == [], "the stack signal reached the test's own process"


def _ledger(folder: Path, rank: int, pid: Any, start: Any) -> Path:
    path = folder / f"attempt-0-rank-{rank}.ledger"
    entry = {"rank": rank, "pid": pid, "start": start, "main_thread": 1, "seq": 0, "since": time.time()}
    path.write_text(json.dumps(entry).ljust(1023) + "\n")
    return path


def _started(**env: str) -> Any:
    child = start_python("-c", _SLEEPER, env=env)
    read_lines_until(child, "ready", 1, timeout_s=60)
    return child


@pytest.mark.multiprocess
@pytest.mark.parametrize("ledger", ["stale", "forged, another run", "forged, another rank"])
def test_a_ledger_naming_a_live_process_that_is_not_the_worker_signals_nothing(launched: Path, ledger: str) -> None:
    other_run = launched.parent / "another-run"
    env = {
        "stale": {"MULTIGPU_FAILURE_DIR": str(launched), "RANK": "0"},  # even this run's env: the start time differs
        "forged, another run": {"MULTIGPU_FAILURE_DIR": str(other_run), "RANK": "0"},
        "forged, another rank": {"MULTIGPU_FAILURE_DIR": str(launched), "RANK": "5"},
    }[ledger]
    bystander = _started(**env)
    try:
        start = peers.start_time(bystander.pid)
        assert start > 0
        _ledger(launched, 0, bystander.pid, start - 100 if ledger == "stale" else start)
        tracking.request_peer_stacks(wait_s=0.5)
        time.sleep(0.5)  # a signal's default action would have ended it by now
        assert bystander.poll() is None, f"the bystander was signalled (exit {bystander.returncode})"
        assert not (launched / "attempt-0-rank-0.stacks").exists()
    finally:
        kill_tree(bystander)


@pytest.mark.multiprocess
def test_a_ledger_naming_a_pid_no_process_holds_signals_nothing(launched: Path) -> None:
    _ledger(launched, 0, finished_pid(), 12345)
    tracking.request_peer_stacks(wait_s=0.2)


@pytest.mark.multiprocess
def test_a_real_worker_of_the_run_is_asked_and_writes_its_stack(launched: Path) -> None:
    worker = start_python(
        "-c",
        "import time\nfrom multigpu.runtime import tracking\ntracking.setup_worker()\n"
        "def waiting_for_its_peer():\n    print('ready', flush=True)\n    time.sleep(120)\n"  # ready: in it
        "waiting_for_its_peer()\n",
        env={"MULTIGPU_FAILURE_DIR": str(launched), "RANK": "0", "WORLD_SIZE": "2"},
    )
    try:
        read_lines_until(worker, "ready", 1, timeout_s=120)
        entry = tracking.read_ledgers(launched, attempt=0)[0]
        assert (entry.pid, entry.start) == (worker.pid, peers.start_time(worker.pid))
        tracking.request_peer_stacks(wait_s=30)
        assert "in waiting_for_its_peer" in tracking.read_stack(launched, attempt=0, rank=0)
        assert worker.poll() is None  # asked, not stopped
    finally:
        kill_tree(worker)


@pytest.mark.parametrize("pid", [0, -1, -4242, 1, 2**40, "12", 12.5, True, None])
def test_a_ledger_naming_an_impossible_pid_is_refused_and_signals_nothing(launched: Path, pid: Any) -> None:
    path = _ledger(launched, 0, pid, 12345)
    skipped: list[str] = []
    assert tracking.read_ledgers(launched, attempt=0, skipped=skipped) == {}
    assert len(skipped) == 1 and skipped[0].startswith(f"{path}: its ")
    tracking.request_peer_stacks(wait_s=0.2)  # nothing to ask; the fixture checks no signal came here


@pytest.mark.parametrize("pid", [0, -1, -4242, 1, 2**40, 2**31 - 1])
def test_no_pid_but_a_proven_worker_s_is_signalled(launched: Path, pid: int) -> None:
    start = peers.start_time()
    assert not peers.signal_peer(pid, tracking.STACK_SIGNAL, rank=0, start=start, run_dir=str(launched))
    assert not peers.signal_peer(os.getpid(), tracking.STACK_SIGNAL, rank=1, start=start, run_dir=str(launched))


# -- a measurement's workers, ended by their process group (multigpu.launcher.measure) ------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("record", ["stale", "forged"])
def test_a_pid_file_naming_a_live_group_that_is_not_the_worker_kills_nothing(tmp_path: Path, record: str) -> None:
    spec = tmp_path / "spec.json"
    bystander = start_python("-c", _SLEEPER, "another-run/spec.json")  # a session leader, as a worker is
    try:
        read_lines_until(bystander, "ready", 1, timeout_s=60)
        start = peers.start_time(bystander.pid)
        (tmp_path / "pid0").write_text(f"{bystander.pid} {start - 100 if record == 'stale' else start}")
        measure._kill_workers(tmp_path, spec)
        time.sleep(0.3)
        assert bystander.poll() is None, f"the bystander was killed (exit {bystander.returncode})"
    finally:
        kill_tree(bystander)


@pytest.mark.multiprocess
def test_a_measurement_s_own_worker_is_killed_with_its_group(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    worker = start_python("-c", _SLEEPER, str(spec))
    try:
        read_lines_until(worker, "ready", 1, timeout_s=60)
        (tmp_path / "pid0").write_text(f"{worker.pid} {peers.start_time(worker.pid)}")
        measure._kill_workers(tmp_path, spec)
        assert worker.wait(timeout=30) == -signal.SIGKILL
    finally:
        kill_tree(worker)


@pytest.mark.parametrize("text", ["0 5", "1 5", "-1 5", "-4242 5", f"{2**40} 5", "12", "x y", "", "\xff"])
def test_a_pid_file_of_garbage_kills_nothing(tmp_path: Path, text: str) -> None:
    (tmp_path / "pid0").write_text(text, errors="surrogateescape")
    measure._kill_workers(tmp_path, tmp_path / "spec.json")  # the test's own process is still here to assert


@pytest.mark.parametrize("pgid", [0, 1, -1, -4242, 2**40])
def test_no_group_but_a_proven_worker_s_is_signalled(tmp_path: Path, pgid: int) -> None:
    # signal 0 only checks: were the guard gone, killpg(1, 0) would succeed where kill(-1, SIGKILL) kills all
    assert not peers.signal_group(pgid, 0, start=peers.start_time(), argument=str(tmp_path))
    assert not peers.signal_group(os.getpgrp(), 0, start=peers.start_time(), argument=sys.argv[0])
