"""Pre-emption: SIGTERM to the launcher, or to one worker, stops every rank at one agreed step; the
loop saves; a relaunch resumes there and ends on the weights of an uninterrupted run (plain torch).
The launcher here also reads its flags from a --config file and, stopped by the signal, requeues
the SLURM job through ``scontrol`` (a stand-in on PATH that records its arguments)."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest
import torch

from tests.launching import kill_tree, multigpu_launch, read_lines_until, start_launch
from tests.runtime.preempt_worker import oracle

pytestmark = pytest.mark.multiprocess

WORKER = "tests/runtime/preempt_worker.py"
STEPS = 40  # far more than run before the signal: the stop, not the end, ends the first run


def _fake_scontrol(folder: Path) -> Path:
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    tool.write_text(f'#!/bin/sh\necho "$@" > {folder / "scontrol.args"}\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.mark.parametrize("target", ["launcher", "worker"])
def test_a_signal_stops_every_rank_at_one_step_and_the_resume_ends_on_the_same_weights(
    tmp_path: Path, target: str
) -> None:
    folder = tmp_path / "ckpt"
    config = tmp_path / "run.toml"
    config.write_text('strategy = "ddp"\nnproc-per-node = 2\ngrace-period = 60\n')
    env = {
        "PATH": f"{_fake_scontrol(tmp_path)}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "31337",
        "OMP_NUM_THREADS": "1",
    }
    launcher = start_launch("--config", str(config), "--requeue", WORKER, str(folder), str(STEPS), "slow", env=env)
    try:
        read_lines_until(launcher, "step ", 2, timeout_s=120)  # both ranks have trained: the handlers are in
        if target == "launcher":
            launcher.send_signal(signal.SIGTERM)
        else:
            worker = next(pid for pid in _workers(launcher.pid))
            os.kill(worker, signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
    finally:
        kill_tree(launcher)
    stopped = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("stopped "))
    assert [rank for rank, _ in stopped] == ["0", "1"], f"{out}\n{err[-3000:]}"
    steps = {int(step) for _, step in stopped}
    assert len(steps) == 1, stopped  # one agreed step
    stop = steps.pop()
    assert 0 < stop < STEPS
    if target == "launcher":  # the launcher reports the stop (128 + SIGTERM) and requeues the job
        assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "31337"]
    else:  # a worker's signal: the run saved and ended cleanly, nothing to requeue
        assert launcher.returncode == 0, err[-3000:]
        assert not (tmp_path / "scontrol.args").exists()
    assert not (folder / "final.pt").exists()

    end = str(stop + 3)
    resumed = multigpu_launch("--strategy", "ddp", "--nproc-per-node", "2", WORKER, str(folder), end, timeout_s=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "world 0 2" in resumed.stdout
    final, expected = torch.load(folder / "final.pt"), oracle(stop + 3)
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=1e-5, atol=1e-6)


def _workers(launcher_pid: int) -> list[int]:
    """The ddp workers: python processes running the worker script below the launcher."""
    from tests.launching import descendants

    found = []
    for pid in descendants(launcher_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(WORKER.encode()) for part in cmdline) and b"multigpu.launcher._entry" in cmdline:
            found.append(pid)
    assert found, "no worker process found below the launcher"
    return found


_UNTIL_STOPPED = """
import os, time
from multigpu.session import Session
with Session() as session:
    steps = 0
    while not session.should_stop:  # the first read installs the handlers
        if steps == 1:
            os.write(1, f"ready {session.global_rank}\\n".encode())
        steps += 1
        time.sleep(0.05)
    os.write(1, f"saved {session.global_rank} {steps}\\n".encode())
"""


@pytest.mark.parametrize(("mode", "workers"), [(["--strategy", "single"], 1), (["--strategy", "ddp"], 2)])
def test_sigusr1_to_the_launcher_reaches_the_loop_and_the_exit_code_says_so(
    tmp_path: Path, mode: list[str], workers: int
) -> None:
    """SLURM's warning signal (``--signal=USR1@N``): forwarded in both launch modes; the script saves and
    exits cleanly; the launcher exits 128 + SIGUSR1 so that a job script knows it was a pre-emption."""
    script = tmp_path / "until_stopped.py"
    script.write_text(_UNTIL_STOPPED)
    launcher = start_launch(*mode, "--nproc-per-node", str(workers), str(script), env={"OMP_NUM_THREADS": "1"})
    try:
        read_lines_until(launcher, "ready ", workers, timeout_s=120)
        launcher.send_signal(signal.SIGUSR1)
        out, err = launcher.communicate(timeout=60)
    finally:
        kill_tree(launcher)
    saved = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("saved "))
    assert [rank for rank, _ in saved] == [str(r) for r in range(workers)], f"{out}\n{err[-2000:]}"
    assert len({steps for _, steps in saved}) == 1  # one agreed step
    assert launcher.returncode == 128 + signal.SIGUSR1, err[-2000:]
