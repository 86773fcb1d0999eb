"""The demo's DDP run: real processes through multigpu launch end where one device ends."""

from __future__ import annotations

import pytest
import torch

from multigpu.demo.data import load_digits
from multigpu.demo.ddp import run_ddp
from multigpu.demo.train import Plan, TrainConfig, max_weight_difference, train_run

pytestmark = pytest.mark.multiprocess


def test_ddp_run_matches_one_device_on_the_same_global_batches() -> None:
    config = TrainConfig(epochs=1)  # 12 steps; the last global batch (29) does not divide by 2
    ddp = run_ddp(config, nproc_per_node=2, timeout_s=120)
    one = train_run(Plan("one device", "cpu", lambda m: m), load_digits(), config)
    assert ddp.name == "DDP, 2 processes"
    torch.testing.assert_close(torch.tensor(ddp.losses), torch.tensor(one.losses), rtol=1e-4, atol=1e-5)
    assert max_weight_difference(ddp, one) < 1e-4
    assert ddp.accuracy == pytest.approx(one.accuracy, abs=0.01)
    assert ddp.samples_per_s > 0
