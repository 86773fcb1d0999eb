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

from tests.distributed.preempt_worker import oracle
from tests.launching import kill_tree, multigpu_launch, read_lines_until, start_launch

pytestmark = pytest.mark.multiprocess

WORKER = "tests/distributed/preempt_worker.py"
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
