"""Faults of a real 2-process DDP run over gloo on 127.0.0.1, launched with ``multigpu launch``.

Each test times the teardown from the moment of the failure (recorded by the failing worker)
to the moment every process of the run is gone, and prints it (``pytest -s`` shows it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import multigpu.checkpoint as ckpt
from multigpu.checkpoint.formats import read_tensors
from tests.checkpoint import _training as tr
from tests.launching import kill_tree, start_launch

# Up to four launches per test (the restart test: 17 s alone, 54-67 s beside another test file's workers).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).parent / "workers" / "ddp_worker.py"
# The worker's default process group times out after this long: a teardown that took as long waited for that
# timeout instead of reacting to the failure. The bound is this, not a speed (teardown times move with the
# machine's load, 5-12 s on two busy cores; they are printed).
WORKER_GROUP_TIMEOUT_S = 60


@dataclass
class Run:
    name: str
    process: subprocess.Popen[str]
    root: Path

    @property
    def events(self) -> Path:
        return self.root / f"{self.name}-events"

    @property
    def folder(self) -> Path:
        return self.root / f"{self.name}-ckpt"

    @property
    def out(self) -> Path:
        return self.root / f"{self.name}.safetensors"

    def event(self, name: str) -> dict[str, float]:
        return json.loads((self.events / name).read_text())  # type: ignore[no-any-return]


def _start(root: Path, name: str, *worker_args: str, max_restarts: int = 0) -> Run:
    data = root / "digits.safetensors"
    if not data.exists():
        tr.write_digits(data)
    (root / f"{name}-events").mkdir()
    process = start_launch(
        "--strategy",
        "ddp",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(max_restarts),
        str(WORKER),
        "--folder",
        str(root / f"{name}-ckpt"),
        "--events",
        str(root / f"{name}-events"),
        "--out",
        str(root / f"{name}.safetensors"),
        "--data",
        str(data),
        *worker_args,
    )
    return Run(name, process, root)


def _finish(run: Run, limit_s: float = 120) -> tuple[int, str, float]:
    """Wait for the run; returns (exit code, output, time.time() when every process was gone).

    Whatever happens, nothing of the run survives: torchrun's group and every worker are killed.
    """
    try:
        out, err = run.process.communicate(timeout=limit_s)
        gone_at = _wait_until_gone(_worker_pids(run), limit_s=15)
    finally:
        if run.process.poll() is None:
            kill_tree(run.process)
        for pid in _worker_pids(run):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    return run.process.returncode, out + err, gone_at


def _worker_pids(run: Run) -> list[int]:
    return [int(run.event(p.name)["pid"]) for p in run.events.glob("pid-*")]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; only its exit code waits to be read


def _wait_until_gone(pids: list[int], limit_s: float) -> float:
    deadline = time.monotonic() + limit_s
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"worker processes {[p for p in pids if _alive(p)]} outlived the run")
        time.sleep(0.01)
    return time.time()


def test_one_rank_raising_ends_every_rank_and_names_it(tmp_path: Path) -> None:
    run = _start(tmp_path, "raise", "--fault", "raise", "--fault-rank", "1", "--fault-step", "2")
    code, output, gone_at = _finish(run)
    seconds = gone_at - run.event("failed")["time"]
    print(f"\n[fault timing] rank 1 raised -> every process gone: {seconds:.2f} s")
    assert code != 0
    assert "RuntimeError: injected failure in rank 1 at step 2" in output
    assert re.search(r"Traceback \(most recent call last\)", output)
    assert re.search(r"multigpu launch: .* failed on rank 1 ", output), output[-3000:]  # the launcher names the cause
    assert seconds < WORKER_GROUP_TIMEOUT_S  # torn down by the failure, not by a rank timing out


def test_a_hanging_collective_times_out_and_names_the_likely_cause(tmp_path: Path) -> None:
    run = _start(tmp_path, "hang", "--fault", "hang", "--fault-rank", "1", "--fault-step", "2", "--timeout-s", "3")
    code, output, gone_at = _finish(run)
    seconds = gone_at - run.event("failed")["time"]
    print(f"\n[fault timing] rank 1 stopped calling collectives -> every process gone: {seconds:.2f} s (timeout 3 s)")
    assert code != 0
    assert re.search(
        r"CollectiveTimeoutError: training step 2 on rank 0 of world_size 2 timed out after 3 s.*"
        r"another rank stopped calling it",
        output,
    ), output[-3000:]
    assert 3 <= seconds < WORKER_GROUP_TIMEOUT_S  # the training group's 3 s timeout ended it, not the default group's


def test_a_failed_save_on_rank_0_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    run = _start(tmp_path, "save", "--fault", "disk-full", "--fault-rank", "0", "--fault-step", "2")
    code, output, gone_at = _finish(run)
    seconds = gone_at - run.event("failed")["time"]
    print(f"\n[fault timing] rank 0's save hit a full disk -> every process gone: {seconds:.2f} s")
    assert code != 0
    assert re.search(r"\[rank0\]: multigpu.errors.CheckpointError: could not write checkpoint .*step-00000003", output)
    assert re.search(
        r"\[rank1\]: multigpu.errors.CheckpointError: rank 0 failed saving checkpoint .*step-00000003, so no "
        r"checkpoint was written: CheckpointError: could not write",
        output,
    ), output[-3000:]
    assert ckpt.find_latest(run.folder) == run.folder / "step-00000002"
    with pytest.warns(RuntimeWarning, match=r"saved at world_size=2"):
        assert ckpt.Checkpointer(folder=run.folder).resume(model=tr.build_model()) is not None
    assert seconds < WORKER_GROUP_TIMEOUT_S  # torn down by the failure, not by a rank timing out


def test_a_killed_worker_restarts_resumes_and_ends_with_the_uninterrupted_weights(tmp_path: Path) -> None:
    """Restarted by ``multigpu launch --max-restarts 1``, which also keeps restarted gloo workers off the
    previous attempt's rendezvous store (without that, this run hangs at the restart and fails)."""
    reference = _start(tmp_path, "reference")
    code, output, _ = _finish(reference)
    assert code == 0, output[-3000:]
    run = _start(
        tmp_path,
        "restart",
        "--fault",
        "kill",
        "--fault-rank",
        "1",
        "--fault-step",
        "3",
        max_restarts=1,
    )
    code, output, _ = _finish(run)
    assert code == 0, output[-3000:]

    restarted = [run.event(f"start-1-{rank}") for rank in (0, 1)]
    assert [s["resumed_from"] for s in restarted] == [3, 3]
    seconds = max(s["time"] for s in restarted) - run.event("failed")["time"]
    print(f"\n[fault timing] rank 1 SIGKILLed -> both ranks restarted and resumed: {seconds:.2f} s")

    final, expected = read_tensors(run.out)[0], read_tensors(reference.out)[0]
    assert final.keys() == expected.keys()
    for key in expected:
        assert torch.equal(final[key], expected[key]), key

    # Saved at world size 2, resumed here in one process: the weights and optimizer load.
    parts = tr.build_parts()
    with pytest.warns(RuntimeWarning, match=r"resuming at world_size=1 from a checkpoint saved at world_size=2"):
        resumed = ckpt.Checkpointer(folder=run.folder).resume(
            model=parts.model, optimizer=parts.optimizer, scheduler=parts.scheduler, scaler=parts.scaler
        )
    assert resumed is not None and resumed.step == 6 and resumed.saved_world_size == 2
    for key, value in parts.model.state_dict().items():
        assert torch.equal(value, expected[key]), key
