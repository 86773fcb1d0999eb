"""`multigpu profile` shows the figures session.log adds: step time, samples/s and MFU, by a hand count."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from multigpu.cli.main import main
from multigpu.devices import get_device_type

TRAIN = textwrap.dedent(
    """
    import torch
    from torch import nn
    import multigpu

    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    model = multigpu.DataParallel(net, devices="cpu:2")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(20):
        loss = nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
        loss.backward()
        opt.step()
        opt.zero_grad()
    """
)
# per sample: forward 2*(8*32 + 32*3), backward twice that less the first layer's input gradient 2*8*32
HAND_FLOPS_PER_SAMPLE = 3 * 2 * (8 * 32 + 32 * 3) - 2 * 8 * 32


def test_profile_reports_samples_per_second_and_mfu_by_the_hand_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import matplotlib

    # matplotlib keeps its font cache under XDG_CACHE_HOME too: keep it where it is (a new one runs fc-list)
    monkeypatch.setenv("MPLCONFIGDIR", matplotlib.get_cachedir())
    monkeypatch.delenv("MULTIGPU_CACHE_DIR", raising=False)  # which would win over XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the peak FLOPs measured for mfu go here
    script, out = tmp_path / "train.py", tmp_path / "report"
    script.write_text(TRAIN)
    assert main(["profile", "--steps", "3", "--no-probe", "--out", str(out), str(script)]) == 0
    profile = json.loads((out / "profile.json").read_text())
    figures = profile["meta"]["throughput"]
    kept_s = sum(step["wall_s"] for step in profile["steps"])
    assert figures["samples_per_s"] == pytest.approx(3 * 16 / kept_s)  # the warm-up step's samples are not in it
    peak = get_device_type("cpu").peak_flops(
        torch.device("cpu"), torch.float32, tmp_path / "cache" / "multigpu" / "peak-flops.json"
    )
    assert figures["mfu"] == pytest.approx(
        HAND_FLOPS_PER_SAMPLE * figures["samples_per_s"] / peak
    )  # two replicas, one CPU
    assert "Throughput: step" in capsys.readouterr().out
