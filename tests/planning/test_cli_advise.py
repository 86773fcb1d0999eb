"""`multigpu advise`: the table, the one-sentence recommendation, JSON, the figure, and its errors."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from multigpu.cli import advise
from multigpu.cli.main import build_parser, main
from tests.launching import run_command

TINY = "tests.planning._tiny_model"


def test_advise_flags_are_a_decision() -> None:
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command")  # type: ignore[union-attr]
    flags = {opt for action in sub.choices["advise"]._actions for opt in action.option_strings}
    assert flags == {
        "-h",
        "--help",
        "--model",
        "--input-shape",
        "--input-dtype",
        "--optimizer",
        "--precision",
        "--params",
        "--compute-ms",
        "--activation-mb",
        "--output-mb",
        "--utilization",
        "--fsdp-no-reshard",
        "--gpu",
        "--gpu-tflops",
        "--gpu-mem-gb",
        "--gpu-mem-bw",
        "--link",
        "--busbw",
        "--devices-per-node",
        "--network",
        "--pin-memory",
        "--overlap",
        "--devices",
        "--batch",
        "--global-batch",
        "--chunk-sizes",
        "--json",
        "--out",
        "--no-figure",
        "--measure",
        "--budget",
        "--strategies",
        "--recalibrate",
        "--script",
        "--script-args",
    }


def _json(argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> dict[str, Any]:
    assert main(["advise", *argv, "--json", "--out", str(tmp_path / "out")]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_preset_prints_table_recommendation_and_writes_to_the_out_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
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
        "--out",
        "plans",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dp-balanced" in out and "peak GiB/24" in out
    assert "Use DDP on 2 devices" in out or "Use DataParallel on 2 devices" in out
    assert (tmp_path / "plans" / "advise.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "plans" / "advise.json").read_text())["rows"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans"]  # nothing in the current folder


def test_json_plan_uses_the_session_vocabulary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _json(
        ["--model", "resnet50", "--gpu", "a100-80gb", "--link", "nvlink-a100", "--devices", "1,2,8"], capsys, tmp_path
    )
    assert set(plan) == {"inputs", "rows", "recommendation"}
    assert {r["strategy"] for r in plan["rows"]} == {"single", "dp", "dp-balanced", "ddp", "fsdp"}
    assert set(plan["rows"][0]) == {
        "strategy",
        "devices",
        "batch_per_device",
        "step_ms",
        "parts_ms",
        "samples_per_s",
        "scaling",
        "peak_bytes",
        "fits",
    }
    assert plan["recommendation"] == {"strategy": "ddp", "devices": 8, "reason": plan["recommendation"]["reason"]}
    assert plan["inputs"]["model"] == "resnet50" and plan["inputs"]["per_device_batch"] == 32


def test_dataparallel_regimes_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", "resnet50", "--gpu", "a100-80gb", "--link", "nvlink-a100"]
    big = _json([*common, "--devices", "1,8", "--batch", "32"], capsys, tmp_path)
    ms = {r["strategy"]: r["step_ms"] for r in big["rows"] if r["devices"] == 8}
    assert ms["dp"] / ms["ddp"] >= 2
    small = _json([*common, "--input-shape", "3,32,32", "--devices", "1,2,4", "--batch", "256"], capsys, tmp_path)
    tput = {(r["strategy"], r["devices"]): r["samples_per_s"] for r in small["rows"]}
    assert tput[("dp", 2)] < tput[("single", 1)] and tput[("dp", 4)] < tput[("single", 1)]


def test_global_batch_chunk_sizes_and_a_custom_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpu = ["--gpu-tflops", "30", "--gpu-mem-gb", "24", "--gpu-mem-bw", "900", "--link", "pcie4"]
    plan = _json(["--model", "resnet50", *gpu, "--devices", "1,4", "--global-batch", "96"], capsys, tmp_path)
    assert {tuple(r["batch_per_device"]) for r in plan["rows"] if r["strategy"] != "dp-balanced"} == {
        (96,),
        (24, 24, 24, 24),
    }
    assert plan["inputs"]["platform"].startswith("custom") and plan["inputs"]["memory_bytes_per_device"] == 24 * 2**30
    plan = _json(
        [
            "--model",
            "gpt2-124m",
            "--gpu",
            "a100-80gb",
            "--gpu-mem-gb",
            "40",
            "--link",
            "pcie4",
            "--chunk-sizes",
            "4,19,19,18",
        ],
        capsys,
        tmp_path,
    )
    assert [r["batch_per_device"] for r in plan["rows"] if r["strategy"] == "dp"] == [[4, 19, 19, 18]]


def test_a_factory_model_is_counted_on_the_meta_device_for_a_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--model",
        f"{TINY}:build_tokens",
        "--input-shape",
        "16",
        "--input-dtype",
        "long",
        "--gpu",
        "h100",
        "--link",
        "nvlink-h100",
        "--batch",
        "400",
    ]
    plan = _json([*argv, "--devices", "1,2"], capsys, tmp_path)
    assert plan["inputs"]["params"] == 100 * 8 + 8 * 16 * 4 + 4
    assert plan["inputs"]["input_bytes_per_sample"] == 16 * 8  # int64 ids
    # fsdp's default rule: the Embedding (61%) and the Linear (39%) have no children, so each is a group
    assert plan["inputs"]["fsdp_groups"] == [0, 800, 516]


def test_a_factory_from_the_current_folder_on_this_cpu_shows_its_real_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mynet.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "mynet", raising=False)
    assert (
        main(
            [
                "advise",
                "--model",
                "mynet:build",
                "--input-shape",
                "32",
                "--devices",
                "1,2",
                "--global-batch",
                "64",
                "--no-figure",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "2.4 k params" in out and "peak KiB" in out  # 2,372 parameters, not "0.0M"
    assert "Predicted step on cpu" in out and re.search(r"Use \S+", out)


def test_on_cpu_the_recommendation_is_never_slower_than_single(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _json(
        ["--model", f"{TINY}:build", "--input-shape", "32", "--devices", "1,2", "--global-batch", "64"],
        capsys,
        tmp_path,
    )
    rec = plan["recommendation"]
    chosen = next(r for r in plan["rows"] if (r["strategy"], r["devices"]) == (rec["strategy"], rec["devices"]))
    single = next(r for r in plan["rows"] if r["strategy"] == "single")
    assert chosen["samples_per_s"] >= single["samples_per_s"]


def test_fsdp_rows_keep_blocks_gathered_with_no_reshard_and_follow_params(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--model", "gpt2-124m", "--gpu", "a100-80gb", "--link", "pcie4", "--devices", "1,4", "--batch", "2"]
    default = _json(common, capsys, tmp_path)
    kept = _json([*common, "--fsdp-no-reshard"], capsys, tmp_path)
    fsdp = {
        plan["inputs"]["fsdp_reshard_after_forward"]: next(r for r in plan["rows"] if r["strategy"] == "fsdp")
        for plan in (default, kept)
    }
    assert fsdp[False]["peak_bytes"][0] > fsdp[True]["peak_bytes"][0]  # every block stays gathered
    assert fsdp[False]["step_ms"] < fsdp[True]["step_ms"]  # and is not gathered again in backward
    assert default["inputs"]["fsdp_groups"][0] == 50257 * 768 + 1024 * 768 + 2 * 768  # the tied embedding's root
    big = _json([*common, "--params", "1000000000"], capsys, tmp_path)
    assert sum(big["inputs"]["fsdp_groups"]) == 10**9 and len(big["inputs"]["fsdp_groups"]) == 13


@pytest.mark.multiprocess
def test_table_fits_80_columns_when_piped(tmp_path: Path) -> None:
    argv = [
        "advise",
        "--model",
        "gpt2-124m",
        "--gpu",
        "a100-80gb",
        "--link",
        "pcie4",
        "--devices",
        "1,2,4,8",
        "--batch",
        "8",
    ]
    done = run_command(
        [sys.executable, "-m", "multigpu", *argv, "--out", str(tmp_path)], timeout_s=120, env={"COLUMNS": "80"}
    )
    assert done.returncode == 0, done.stderr
    table = done.stdout.split("inputs:")[0].splitlines()
    assert max(len(line) for line in table) <= 80
    assert "…" not in done.stdout.split("inputs:")[0]
    rows = [line.split() for line in table if line.strip().startswith(("single", "dp", "ddp", "fsdp"))]
    assert [r[0] for r in rows[1:5]] == ["dp", "dp-balanced", "ddp", "fsdp"]
    assert [r[1] for r in rows] == ["1"] + ["2"] * 4 + ["4"] * 4 + ["8"] * 4  # the N column is there


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt2-124m"], r"preset 'gpt2-124m' needs --gpu"),
        (["--model", "gpt2-124m", "--gpu", "t4"], r"--gpu t4 needs --link \(one of pcie3"),
        (["--model", "resnet"], r"neither a preset \(gpt2-124m, resnet50.*\) nor 'package.module:factory'"),
        (["--model", f"{TINY}:build"], r"pass --input-shape, e.g. 512"),
        (["--model", f"{TINY}:nope", "--input-shape", "32"], r"cannot import 'nope'"),
        (["--model", f"{TINY}:not_a_module", "--input-shape", "32"], r"returned int, not an nn.Module"),
        (
            ["--model", "resnet50", "--gpu", "t4", "--link", "pcie3", "--devices", "0"],
            r"--devices '0' must be positive integers",
        ),
        (
            ["--model", "resnet50", "--gpu", "t4", "--link", "pcie3", "--batch", "8", "--global-batch", "64"],
            r"not --batch and --global-batch",
        ),
        (
            ["--model", "resnet50", "--gpu", "t4", "--link", "pcie3", "--chunk-sizes", "4,x"],
            r"--chunk-sizes '4,x' must be positive integers",
        ),
        (
            ["--model", "resnet50", "--gpu", "t4", "--link", "pcie3", "--input-shape", "32,32"],
            r"does not fit preset 'resnet50'",
        ),
        (["--model", "resnet50", "--gpu-tflops", "30", "--link", "pcie3"], r"missing --gpu-mem-gb, --gpu-mem-bw"),
        (
            ["--model", f"{TINY}:build", "--input-shape", "32", "--input-dtype", "bf17"],
            r"--input-dtype 'bf17' is not one of",
        ),
        (
            ["--model", "resnet50", "--gpu", "t4", "--link", "pcie3", "--devices", "a,b"],
            r"--devices 'a,b' must be positive integers",
        ),
        (
            ["--model", f"{TINY}:raises", "--input-shape", "3", "--gpu", "t4", "--link", "pcie3"],
            r"factory raised RuntimeError: weights file missing on the meta device",
        ),
        (
            ["--model", "resnet50", "--gpu", "t4", "--busbw", "0"],
            r"argument --busbw: '0': pass GB/s, a finite number > 0",
        ),
        (
            ["--model", "resnet50", "--gpu", "t4", "--link", "pcie3", "--batch", "0"],
            r"argument --batch: '0': pass a batch size, a whole number >= 1",
        ),
    ],
)
def test_bad_input_is_reported_with_the_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    try:
        code = main(["advise", *argv, "--no-figure", "--out", str(tmp_path)])
    except SystemExit as exc:  # a flag's own type refused the value (argparse: exit code 2, message on stderr)
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    printed = capsys.readouterr()
    assert re.search(message, " ".join((printed.out + printed.err).split()))  # rich wraps long lines


def test_module_is_a_subcommand() -> None:
    assert advise.HELP and advise.__doc__ and "multigpu advise" in advise.__doc__
