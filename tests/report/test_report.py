"""The report renders from a real profile: tables, JSON and PNG figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from rich.console import Console
from torch import nn

import multigpu
from multigpu.devices import parse_devices
from multigpu.profiling.bandwidth import KiB, probe_copy, probe_dp_pattern
from multigpu.profiling.records import StepProfile
from multigpu.profiling.step import ProfileConfig, profile_steps
from multigpu.report import figures, tables
from multigpu.report.folder import write_profile_report


@pytest.fixture(scope="module")
def profile() -> StepProfile:
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    model = multigpu.DataParallel(net, devices="cpu:2")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with profile_steps(optimizer=opt, config=ProfileConfig(warmup=1)) as prof:
        for _ in range(4):
            nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,))).backward()
            opt.step()
            opt.zero_grad()
    result = prof.profile()
    for i, step in enumerate(result.steps):  # per-device peaks are data (the memory tracker plugs in here)
        step.peak_bytes = {"cpu:0": 5 * 2**20 + i, "cpu:1": 3 * 2**20}
    return result


def _png(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


def test_report_folder_has_tables_json_and_figures(profile: StepProfile, tmp_path: Path) -> None:
    console = Console(record=True, width=140)
    files = write_profile_report(tmp_path, profile, console=console)
    names = sorted(f.name for f in files)
    assert names == ["bandwidth.png", "memory.png", "phases.png", "profile.json", "summary.txt"]
    printed = console.export_text()
    for text in ("cpu:0", "cpu:1", "forward", "backward", "replicate", "step (wall)", "GB/s", "5.0 MiB"):
        assert text in printed
    assert (tmp_path / "summary.txt").read_text().strip() == printed.strip()
    assert StepProfile.load(tmp_path / "profile.json") == profile
    for png in ("phases.png", "memory.png", "bandwidth.png"):
        width, height = _png(tmp_path / png)
        assert width > 300 and height > 200


def test_no_memory_source_says_so_and_draws_no_memory_figure(profile: StepProfile, tmp_path: Path) -> None:
    bare = StepProfile.from_json(profile.to_json())
    for step in bare.steps:
        step.peak_bytes = {}
    console = Console(record=True, width=140)
    files = write_profile_report(tmp_path, bare, console=console)
    assert "memory.png" not in {f.name for f in files}
    assert "Peak memory: not measured; pass memory=track_memory() to profile_steps to measure it." in (
        console.export_text()
    )


def test_phase_table_shows_medians_per_device(profile: StepProfile) -> None:
    console = Console(record=True, width=140)
    console.print(tables.phase_table(profile))
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if line.count("│") == 4}
    cells = [c.strip() for c in rows["forward"].split("│")[2:4]]
    assert cells == [f"{profile.median_seconds('forward', d) * 1e3:.2f}" for d in ("cpu:0", "cpu:1")]
    assert [c.strip() for c in rows["reduce"].split("│")[2:4]][1] == "-"  # reduce runs on the primary only


def test_bandwidth_figure_and_json_from_real_probes(profile: StepProfile, tmp_path: Path) -> None:
    points = [probe_copy(torch.device("cpu"), torch.device("cpu"), n, repeats=2) for n in (KiB, 16 * KiB)]
    points += probe_dp_pattern(parse_devices("cpu:2"), 16 * KiB, repeats=2)[0]
    files = write_profile_report(tmp_path, profile, bandwidth=points, console=Console(file=None, quiet=True))
    rows = json.loads((tmp_path / "bandwidth.json").read_text())
    assert [r["probe"] for r in rows] == ["copy cpu->cpu", "copy cpu->cpu", "reduce x2->cpu:0"]
    assert rows[0]["algbw_gbps"] == pytest.approx(KiB / rows[0]["seconds"] / 1e9)
    assert tmp_path / "bandwidth.png" in files and _png(tmp_path / "bandwidth.png")[0] > 300
    assert figures.memory_figure({"cuda:0": 2**30, "cuda:1": 2**29}, tmp_path / "m.png").exists()


def test_format_bytes() -> None:
    assert tables.format_bytes(512) == "512 B"
    assert tables.format_bytes(1536) == "1.5 KiB"
    assert tables.format_bytes(3 * 2**30) == "3.0 GiB"
