"""The warm spare restarted fault-tolerant workers are forked from (multigpu.launcher.fault_tolerant_zygote).

Real zygotes (each imports torch, torch._dynamo, torchft and multigpu: seconds on a loaded machine) forking
real workers that run a script through the launcher's entry point; the end-to-end restart through it is in
test_fault_tolerant.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from multigpu.launcher.fault_tolerant_zygote import Zygote
from tests.launching import ROOT, alive

pytestmark = pytest.mark.multiprocess

SCRIPT = str(ROOT / "tests/launcher/zygote_worker.py")
READY_S = 180.0  # the zygote's imports, on a loaded 2-core machine


def base_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def ready_zygote(env: dict[str, str]) -> Zygote:
    zygote = Zygote(env)
    assert zygote.ready.wait(READY_S), "the zygote did not finish its imports"
    return zygote


def until(condition, what: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)


def exists(pid: int) -> bool:
    """Whether ``pid`` names a process at all (a zombie included: not reaped yet)."""
    return Path(f"/proc/{pid}").exists()


def test_a_forked_worker_runs_the_script_as_a_started_one_with_its_variables_and_its_exit_code(tmp_path: Path) -> None:
    zygote = Zygote(base_env())
    try:
        # still importing (seconds): a restart that waits less than that starts a new interpreter
        assert zygote.start_worker(base_env(), [SCRIPT, str(tmp_path / "never"), "exit=0"], ready_wait_s=0) is None
        assert zygote.ready.wait(READY_S), "the zygote did not finish its imports"
        assert zygote.refused is None
        out = tmp_path / "record.json"
        worker = zygote.start_worker(
            {**base_env(), "ZYGOTE_TEST_VALUE": "42", "OMP_NUM_THREADS": "2"}, [SCRIPT, str(out), "exit=3"]
        )
        assert worker is not None
        until(lambda: worker.poll() is not None, "exit report")
        assert worker.returncode == 3
        record = json.loads(out.read_text())
        assert record["pid"] == worker.pid and record["ppid"] == zygote.process.pid  # forked, not started
        assert record["sid"] == worker.pid  # a session of its own, as the launcher's workers have
        assert record["name"] == "__main__" and record["argv"] == [SCRIPT, str(out), "exit=3"]
        assert record["value"] == "42"  # the worker's variables, not the zygote's
        assert (
            record["threads"] == 2
        )  # OMP_NUM_THREADS read at torch's import in the zygote (1): applied after the fork
        assert exists(worker.pid)  # reported, not reaped: its pid (its session's id) cannot be taken yet
        zygote.end([worker])
        until(lambda: not exists(worker.pid), "reaped worker")
        # an uncaught exception in the script: exit code 1, as a started interpreter's
        failing = zygote.start_worker(base_env(), [SCRIPT, str(tmp_path / "none"), "not-a-mode"])
        assert failing is not None
        until(lambda: failing.poll() is not None, "exit report")
        assert failing.returncode == 1
        zygote.end([failing])
    finally:
        zygote.close()
    assert zygote.process.returncode == 0


def test_end_kills_the_workers_sessions_and_a_dead_zygote_leaves_no_worker_and_no_fork(tmp_path: Path) -> None:
    zygote = ready_zygote(base_env())
    try:
        workers, records = [], []
        for index in range(2):
            out = tmp_path / f"w{index}.json"
            worker = zygote.start_worker(base_env(), [SCRIPT, str(out), "hold"])
            assert worker is not None
            until(out.exists, "worker record")
            workers.append(worker)
            records.append(json.loads(out.read_text()))
        first, second = workers
        # numpy is seeded anew in each fork (Python's random reseeds itself at fork), as in new interpreters:
        # two workers do not repeat each other's draws
        assert records[0]["draws"][0] != records[1]["draws"][0] and records[0]["draws"][1] != records[1]["draws"][1]
        zygote.end([first])  # the launcher's kill of a lost group
        assert first.returncode == -signal.SIGKILL
        assert not alive([first.pid, records[0]["helper"]])  # its helper, in a group of its own, too
        # the zygote dies: its running worker cannot be watched any more; it is ended and reported killed
        os.kill(zygote.process.pid, signal.SIGKILL)
        until(lambda: second.poll() is not None, "the orphan's report")
        assert second.returncode == -signal.SIGKILL
        until(lambda: not alive([second.pid, records[1]["helper"]]), "the orphaned session's end")
        assert zygote.start_worker(base_env(), [SCRIPT, str(tmp_path / "never"), "exit=0"]) is None  # the caller spawns
    finally:
        zygote.close()


def test_a_zygote_with_a_thread_refuses_to_fork(tmp_path: Path) -> None:
    # a library that starts a thread at import (here: at the interpreter's start) would leave its locks
    # held in every fork
    (tmp_path / "sitecustomize.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    env = base_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    zygote = ready_zygote(env)
    try:
        assert zygote.refused is not None and "2 threads" in zygote.refused
        assert zygote.start_worker(base_env(), [SCRIPT, str(tmp_path / "never"), "exit=0"]) is None
    finally:
        zygote.close()


def test_a_restart_asked_of_a_zygote_still_importing_waits_for_it_and_is_forked(tmp_path: Path) -> None:
    # a group lost while the zygote imports: the zygote, started first, is ready before a new interpreter would be
    zygote = Zygote(base_env())
    try:
        assert not zygote.ready.is_set()
        out = tmp_path / "record.json"
        worker = zygote.start_worker(base_env(), [SCRIPT, str(out), "exit=0"], ready_wait_s=READY_S)
        assert worker is not None
        until(lambda: worker.poll() is not None, "exit report")
        assert worker.returncode == 0 and json.loads(out.read_text())["ppid"] == zygote.process.pid
        zygote.end([worker])
    finally:
        zygote.close()
