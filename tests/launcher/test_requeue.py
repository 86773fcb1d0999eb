"""``--requeue`` when ``scontrol`` misbehaves: the launcher ends in bounded time and keeps the pre-emption's code.

``scontrol`` is the outside program here, so each case puts a real stand-in script on PATH: one that hangs
(and leaves a child holding its output), one missing or not executable, one that cannot start, one that
prints bytes that are not UTF-8 and fails, one that prints without end. The launcher's own
:func:`maybe_requeue` runs it; last, a real ``multigpu launch`` stopped by SIGTERM keeps exit code 143.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import pytest

from multigpu.launcher.launch import LaunchConfig
from multigpu.launcher.preemption import maybe_requeue
from tests.launching import alive, kill_tree, start_launch

PREEMPTED = 128 + signal.SIGTERM
JOB = "31337"


def _fake_scontrol(folder: Path, body: str, *, executable: bool = True, shebang: str = "#!/bin/sh") -> Path:
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "scontrol"
    tool.write_text(f"{shebang}\n{body}\n")
    if executable:
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.fixture
def slurm_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("SLURM_JOB_ID", JOB)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    return tmp_path


def _requeue(capsys: pytest.CaptureFixture[str], timeout_s: float = 20.0) -> tuple[int, str, float]:
    started = time.monotonic()
    code = maybe_requeue(LaunchConfig(requeue=True), PREEMPTED, timeout_s=timeout_s)
    return code, capsys.readouterr().err, time.monotonic() - started


@pytest.mark.multiprocess
def test_a_hanging_scontrol_is_killed_with_what_it_started(slurm_job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pids = slurm_job / "pids"
    _fake_scontrol(slurm_job, f"sleep 300 &\necho $$ $! > {pids}\nwait")
    code, err, took = _requeue(capsys, timeout_s=1.0)
    assert code == PREEMPTED and took < 10, (code, took)
    assert f"'scontrol requeue {JOB}' did not answer within 1 s; the job was not requeued" in err, err
    assert f"requeue it by hand (scontrol requeue {JOB})" in err
    deadline = time.monotonic() + 10
    while alive([int(p) for p in pids.read_text().split()]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive([int(p) for p in pids.read_text().split()]) == []  # its sleep too, which held the pipe


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            "printf 'scontrol: error: \\377\\376 Invalid job id\\n' >&2; exit 1",
            "failed (exit code 1): scontrol: error:",
        ),
        ("exit 3", "failed (exit code 3): (no message)"),
        ("kill -KILL $$", "failed (killed by signal 9)"),
    ],
)
def test_a_failing_scontrol_is_reported_and_the_code_kept(
    slurm_job: Path, capsys: pytest.CaptureFixture[str], body: str, said: str
) -> None:
    _fake_scontrol(slurm_job, body)
    code, err, _ = _requeue(capsys)
    assert code == PREEMPTED
    assert f"'scontrol requeue {JOB}' {said}" in err, err
    assert "the job was not requeued" in err


@pytest.mark.multiprocess
def test_an_scontrol_that_prints_without_end_is_cut_short(slurm_job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_scontrol(slurm_job, "while :; do echo flood; done")
    code, err, took = _requeue(capsys, timeout_s=1.0)
    assert code == PREEMPTED and took < 10
    assert "did not answer within 1 s" in err and len(err) < 2000, err[:300]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["missing", "not executable", "cannot start"])
def test_an_scontrol_that_cannot_run_is_named_and_the_code_kept(
    slurm_job: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    if case == "not executable":
        _fake_scontrol(slurm_job, "exit 0", executable=False)
    elif case == "cannot start":
        _fake_scontrol(slurm_job, "exit 0", shebang="#!/nonexistent/interpreter")
    code, err, _ = _requeue(capsys)
    assert code == PREEMPTED
    if case == "cannot start":
        assert f"'scontrol requeue {JOB}' could not run (" in err and "the job was not requeued" in err, err
    else:
        assert "'scontrol' is not on PATH; requeue the job by hand" in err, err


@pytest.mark.multiprocess
def test_a_working_scontrol_requeues_the_job(slurm_job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_scontrol(slurm_job, f'echo "$@" > {slurm_job / "args"}')
    code, err, _ = _requeue(capsys)
    assert code == PREEMPTED and f"requeued SLURM job {JOB}" in err
    assert (slurm_job / "args").read_text().split() == ["requeue", JOB]


@pytest.mark.multiprocess
def test_a_launch_stopped_by_sigterm_keeps_143_when_scontrol_prints_garbage(tmp_path: Path) -> None:
    bin_dir = _fake_scontrol(tmp_path, "printf '\\377\\376\\375\\n'; exit 1")
    script = tmp_path / "preempted.py"
    script.write_text("import os, signal, time\nos.kill(os.getppid(), signal.SIGTERM)\ntime.sleep(60)\n")
    launcher = start_launch(
        "--strategy",
        "single",
        "--requeue",
        "--grace-period",
        "10",
        str(script),
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": JOB},
    )
    try:
        _, err = launcher.communicate(timeout=120)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == PREEMPTED, err[-3000:]
    assert f"'scontrol requeue {JOB}' failed (exit code 1)" in err, err[-3000:]
