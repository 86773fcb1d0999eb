"""`multigpu advise`: the table, the one-sentence recommendation, the figure, and its errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from multigpu.cli import advise
from multigpu.cli.main import build_parser, main


def test_advise_flags_are_a_decision() -> None:
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command")  # type: ignore[union-attr]
    flags = {opt for action in sub.choices["advise"]._actions for opt in action.option_strings}
    assert flags == {
        "-h",
        "--help",
        "--model",
        "--input-shape",
        "--gpu",
        "--link",
        "--busbw",
        "--devices",
        "--batch",
        "--optimizer",
        "--precision",
        "--params",
        "--compute-ms",
        "--activation-mb",
        "--output-mb",
        "--utilization",
        "--overlap",
        "--devices-per-node",
        "--network",
        "--figure",
        "--no-figure",
    }


def test_preset_on_gpus_prints_table_recommendation_and_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figure = tmp_path / "advise.png"
    argv = [
        "advise",
        "--model",
        "gpt2-124m",
        "--gpu",
        "titan-rtx",
        "--link",
        "pcie3-nop2p",
        "--devices",
        "1,2",
        "--batch",
        "4",
        "--figure",
        str(figure),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "DDP" in out and "DP-bal" in out and "peak GiB/24" in out
    # Without P2P, all-reduce through host memory costs more than DataParallel's copies do not.
    assert "Use DDP on 2 devices" in out or "Use DataParallel on 2 devices" in out
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measured_bandwidth_replaces_the_link(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["advise", "--model", "resnet50", "--gpu", "a100-80gb", "--busbw", "0.5", "--devices", "1,8", "--no-figure"]
    assert main(argv) == 0
    assert "measured" in capsys.readouterr().out


def test_factory_model_is_measured_on_this_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "advise",
        "--model",
        "tests.planning._tiny_model:build",
        "--input-shape",
        "32",
        "--devices",
        "1,2",
        "--batch",
        "16",
        "--no-figure",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Predicted step on cpu" in out and "Use " in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt2-124m"], r"preset 'gpt2-124m' needs --gpu"),
        (["--model", "gpt2-124m", "--gpu", "t4"], r"--gpu t4 needs --link \(one of pcie3"),
        (["--model", "resnet"], r"neither a preset nor 'package.module:factory'"),
        (["--model", "tests.planning._tiny_model:build"], r"pass --input-shape, e.g. 512"),
        (["--model", "tests.planning._tiny_model:nope", "--input-shape", "32"], r"cannot import 'nope'"),
        (
            ["--model", "tests.planning._tiny_model:not_a_module", "--input-shape", "32"],
            r"returned int, not an nn.Module",
        ),
        (["--model", "resnet50", "--gpu", "t4", "--link", "pcie3", "--devices", "0"], r"device counts \[0\] must be"),
    ],
)
def test_bad_input_is_reported_with_the_fix(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", *argv, "--no-figure"]) == 2
    assert re.search(message, " ".join(capsys.readouterr().out.split()))  # rich wraps long lines


def test_module_is_a_subcommand() -> None:
    assert advise.HELP and advise.__doc__ and "multigpu advise" in advise.__doc__
