"""examples/train.py, unchanged, under single, dp and ddp: the same weights at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launching import ROOT, multigpu_launch

pytestmark = pytest.mark.multiprocess

SCRIPT = str(ROOT / "examples" / "train.py")
STRATEGY_ARGS = {
    "single": ["--strategy", "single"],
    "dp": ["--strategy", "dp", "--devices", "cpu:2"],
    "ddp": ["--strategy", "ddp", "--nproc-per-node", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("example")
    results = {}
    for name, launch_args in STRATEGY_ARGS.items():
        path = out / f"{name}.pt"
        args = ["--epochs", "1", "--max-steps", "6", "--save", str(path)]
        done = multigpu_launch(*launch_args, SCRIPT, *args, timeout_s=90)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"[{name} x" in done.stdout and done.stdout.count("epoch 0") == 1  # printed once
        results[name] = torch.load(path)
    return results


@pytest.mark.parametrize("strategy", ["dp", "ddp"])
def test_same_script_same_result_as_single(runs: dict[str, dict[str, Any]], strategy: str) -> None:
    want, got = runs["single"], runs[strategy]
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, rtol=1e-5, atol=1e-6)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert len(got["losses"]) == 6
