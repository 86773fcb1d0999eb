"""`multigpu profile`, `multigpu bandwidth` and `multigpu env`, run through the real entry point."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from multigpu.cli.main import build_parser, main

TRAIN = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    from torch import nn
    import multigpu

    steps = int(sys.argv[1])
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    model = multigpu.DataParallel(net, devices="cpu:2")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(steps):
        try:
            loss = nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
            loss.backward()
            opt.step()
            opt.zero_grad()
        except Exception:  # user code that swallows errors must not swallow the profiler's stop
            raise SystemExit("swallowed")
    Path(sys.argv[2]).write_text("finished")
    """
)


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def test_profile_runs_a_few_steps_and_writes_the_report(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, marker = tmp_path / "report", tmp_path / "finished.txt"
    assert (
        main(
            [
                "profile",
                "--steps",
                "3",
                "--warmup",
                "1",
                "--no-probe",
                "--out",
                str(out),
                str(script),
                "100",
                str(marker),
            ]
        )
        == 0
    )
    assert not marker.exists()  # stopped after warm-up + 3 steps, long before its 100
    profile = json.loads((out / "profile.json").read_text())
    assert len(profile["steps"]) == 3 and profile["devices"] == ["cpu:0", "cpu:1"]
    assert profile["meta"]["script"] == str(script)
    assert {p.name for p in out.iterdir()} == {"summary.txt", "profile.json", "phases.png", "bandwidth.png"}
    assert "Time per step by phase and device" in capsys.readouterr().out


def test_profile_with_memory_shows_the_primary_carrying_more(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert (
        main(
            [
                "profile",
                "--steps",
                "2",
                "--memory",
                "--no-probe",
                "--out",
                str(out),
                str(script),
                "10",
                str(tmp_path / "m"),
            ]
        )
        == 0
    )
    profile = json.loads((out / "profile.json").read_text())
    peaks = profile["steps"][-1]["peak_bytes"]
    assert set(peaks) == {"cpu:0", "cpu:1"}
    assert peaks["cpu:0"] > peaks["cpu:1"] > 0  # the primary also holds the gathered outputs and the loss
    assert (out / "memory.png").exists()


def test_profile_with_trace_and_probes(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    args = [
        "profile",
        "--steps",
        "1",
        "--trace",
        "--probe-max-size",
        "64KiB",
        "--out",
        str(out),
        str(script),
        "5",
        str(tmp_path / "m"),
    ]
    assert main(args) == 0
    trace = (out / "trace.json").read_text()
    assert "multigpu::forward" in trace and "multigpu::reduce" in trace
    probes = {row["probe"] for row in json.loads((out / "bandwidth.json").read_text())}
    assert probes == {"copy cpu->cpu", "reduce x2->cpu:0"}


def test_profile_of_a_script_that_never_steps_explains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    idle = tmp_path / "idle.py"
    idle.write_text("print('no optimizer here')\n")
    assert main(["profile", "--out", str(tmp_path / "r"), str(idle)]) == 2
    assert (
        "finished before a step was kept (warm-up 1): a step ends at each optimizer.step()" in capsys.readouterr().err
    )


def test_profile_reports_a_script_that_exits_by_itself(tmp_path: Path) -> None:
    short = tmp_path / "short.py"
    short.write_text(TRAIN.replace('Path(sys.argv[2]).write_text("finished")', "sys.exit(0)"))
    out = tmp_path / "r"
    assert main(["profile", "--steps", "50", "--no-probe", "--out", str(out), str(short), "3", "unused"]) == 0
    assert len(json.loads((out / "profile.json").read_text())["steps"]) == 2  # 3 steps, 1 warm-up


def test_profile_of_a_missing_script_explains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", str(tmp_path / "nope.py")]) == 2
    assert "is not a file; give the path of your training script" in capsys.readouterr().err


def test_bandwidth_writes_table_png_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "bandwidth",
        "--max-size",
        "16KiB",
        "--factor",
        "4",
        "--repeats",
        "2",
        "--no-all-reduce",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    rows = json.loads((tmp_path / "bandwidth.json").read_text())
    assert sorted({r["nbytes"] for r in rows}) == [1024, 4096, 16384]
    assert {r["probe"] for r in rows} == {"copy cpu->cpu", "reduce x2->cpu:0"}
    assert (tmp_path / "bandwidth.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "busbw GB/s" in printed and "no bytes move" in printed


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs fewer than 2 GPUs: nccl must be unusable")
def test_bandwidth_without_enough_gpus_for_nccl_still_reports_the_local_probes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "bandwidth",
        "--max-size",
        "4KiB",
        "--factor",
        "4",
        "--repeats",
        "1",
        "--backend",
        "nccl",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out.replace("\n", "")
    assert "all-reduce not probed: world_size=2 with nccl needs one GPU per process" in printed
    assert {r["probe"] for r in json.loads((tmp_path / "bandwidth.json").read_text())} >= {"copy cpu->cpu"}


def test_bandwidth_rejects_a_bad_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bandwidth", "--max-size", "lots", "--out", str(tmp_path)]) == 2
    assert "size 'lots' does not parse" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_env_prints_versions_devices_backends(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    for line in (f"torch: {torch.__version__}", "gloo: yes", "cpu:", "NCCL_DEBUG: INFO", "python: "):
        assert line in text
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["environment variables"]["NCCL_DEBUG"] == "INFO"


def test_flags_of_the_measuring_commands() -> None:
    """The public CLI surface: changing a flag is a decision, made here."""
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices  # type: ignore[union-attr]

    def flags(name: str) -> set[str]:
        return {s for a in sub[name]._actions for s in a.option_strings} - {"-h", "--help"}

    assert flags("profile") == {"--steps", "--warmup", "--out", "--trace", "--memory", "--no-probe", "--probe-max-size"}
    assert flags("bandwidth") == {
        "--min-size",
        "--max-size",
        "--factor",
        "--devices",
        "--world-size",
        "--backend",
        "--no-all-reduce",
        "--repeats",
        "--timeout",
        "--out",
    }
    assert flags("env") == {"--json"}
