from __future__ import annotations

import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.strategies.precision import BF16, FP16, Precision, build_precision


def test_registry_builds_each_precision_by_name() -> None:
    assert type(build_precision("fp32", "cpu")) is Precision
    assert type(build_precision("bf16", "cpu")) is BF16
    assert type(build_precision("fp16", "cpu")) is FP16
    with pytest.raises(ConfigError, match=r"precision='half' is not one of \['bf16', 'fp16', 'fp32'\]; use e.g."):
        build_precision("half", "cpu")


def test_fp16_skips_a_step_whose_gradients_overflowed_and_keeps_scaler_state() -> None:
    precision = build_precision("fp16", "cpu")
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=1.0)
    precision.scale_loss((param * torch.tensor([1.0, float("inf"), 1.0])).sum()).backward()
    scale_before = precision.state_dict()["scaler"]["scale"]
    precision.step(optimizer)
    torch.testing.assert_close(param.detach(), torch.ones(3))  # step skipped
    assert precision.state_dict()["scaler"]["scale"] < scale_before  # and the scale backed off
    restored = build_precision("fp16", "cpu")
    restored.load_state_dict(precision.state_dict())
    assert restored.state_dict()["scaler"]["scale"] == precision.state_dict()["scaler"]["scale"]
