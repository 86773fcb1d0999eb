"""CUDA paths: nccl and one process per GPU. Skipped where no GPU is visible."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multigpu.errors import DeviceError
from multigpu.launcher.launch import LaunchConfig
from multigpu.launcher.torchrun import resolve_nproc
from multigpu.runtime.world import check_world_matches_devices
from tests.launching import ROOT, multigpu_launch


@pytest.mark.cuda
def test_auto_starts_one_process_per_gpu_and_refuses_more() -> None:
    count = torch.cuda.device_count()
    assert resolve_nproc(LaunchConfig()) == count
    with pytest.raises(DeviceError, match=f"--nproc-per-node {count}"):
        check_world_matches_devices(count + 1, "cuda", count)
    with pytest.raises(DeviceError, match="this node sees"):
        resolve_nproc(LaunchConfig(nproc_per_node=count + 1))


@pytest.mark.cuda
@pytest.mark.multiprocess
def test_example_trains_with_nccl_on_every_gpu(tmp_path: Path) -> None:
    out = tmp_path / "ddp.pt"
    script = str(ROOT / "examples" / "train.py")
    done = multigpu_launch("--strategy", "ddp", script, "--epochs", "1", "--save", str(out), timeout_s=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.load(out)["accuracy"] > 0.5
