"""``multigpu launch``'s flags with absurd values: each ends in a message naming the value and the fix and
exit code 2, before any worker starts and without a traceback (in-process through the command's ``run``,
and once through the real command)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from multigpu.cli import launch as launch_cli
from tests.launching import run_command


@pytest.fixture(autouse=True)
def _no_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith(("PET_", "SLURM_"))]:
        monkeypatch.delenv(key)


def _run(argv: list[str], tmp_path: Path) -> int:
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit('the script ran')\n")
    parser = argparse.ArgumentParser()
    launch_cli.add_arguments(parser)
    return launch_cli.run(parser.parse_args([*argv, str(script)]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--nproc-per-node", "2", "--log-dir", "/dev/null/logs"],
            "--log-dir /dev/null/logs: cannot write there (Not a directory); pass a folder",
        ),
        (
            ["--nproc-per-node", "2", "--local-ranks-filter", "5"],
            "--local-ranks-filter 5 names local rank(s) [5], but this node runs 2 process(es), local ranks 0..1",
        ),
        (["--nproc-per-node", "10000"], "--nproc-per-node 10000: more processes than this node runs (at most"),
        (["--rdzv-conf", "garbage"], "--rdzv-conf 'garbage': 'garbage' is not KEY=VALUE"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:port"], "--rdzv-endpoint 'h:port': The port number"),
        (["--rdzv-id", ""], "--rdzv-id '' is empty (torchrun would make up a different one on every node)"),
        (["--master-addr", " "], "--master-addr ' ' is empty; pass an address"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1"], "node_rank=2 with nnodes='2'"),
        (["--threads-per-process", "100000"], "threads_per_process=100000: pass a thread count from 1 to"),
        (["--strategy", "single", "--log-dir", "logs"], "are the per-rank logs of ddp and fsdp; --strategy single"),
        (["--nproc-per-node", "1", "--tee", "stdout"], "--strategy single runs one process"),  # auto: single
    ],
)
def test_absurd_flags_end_in_a_message_and_exit_code_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(argv, tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith("multigpu launch: ") and message in err, err
    assert "the script ran" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "abc"], "argument --nnodes: 'abc': pass a node count >= 1 (e.g. 2), or MIN:MAX"),
        (["--nnodes", "3:2"], "argument --nnodes: '3:2'"),
        (["--collective-timeout", "inf"], "argument --collective-timeout: 'inf': pass a finite number of seconds > 0"),
        (["--collective-timeout", "nan"], "argument --collective-timeout: 'nan'"),
        (["--collective-timeout", "1e9"], "at most 604800 (7 days)"),
        (["--grace-period", "-1"], "argument --grace-period: '-1': pass a finite number of seconds > 0"),
        (["--node-rank", "-1"], "argument --node-rank: '-1': pass this node's rank, a whole number >= 0"),
        (
            ["--master-port", "70000"],
            "argument --master-port: '70000': pass a TCP port, a whole number from 1 to 65535",
        ),
        (["--max-restarts", "-1"], "argument --max-restarts: '-1': pass a restart count"),
        (["--threads-per-process", "0"], "argument --threads-per-process: '0': pass a thread count"),
    ],
)
def test_flags_of_the_wrong_form_are_refused_by_the_parser(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    launch_cli.add_arguments(parser)
    with pytest.raises(SystemExit) as done:
        parser.parse_args([*argv, "t.py"])
    assert done.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.multiprocess
def test_the_command_itself_prints_no_traceback(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit('the script ran')\n")
    run = tmp_path / "run.toml"
    run.write_bytes(b'strategy = "d\xffp"\n')
    for argv, message in (
        (["--nproc-per-node", "2", "--log-dir", "/dev/null/logs"], "--log-dir /dev/null/logs: cannot write there"),
        (["--config", str(run)], "not UTF-8 text"),
        (["--collective-timeout", "inf"], "argument --collective-timeout: 'inf'"),
    ):
        done = run_command([sys.executable, "-m", "multigpu", "launch", *argv, str(script)], timeout_s=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
