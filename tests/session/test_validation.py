"""Session input is validated like DataParallel's: typed errors that show the value and the fix, never a wrong step."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from multigpu.errors import ConfigError
from multigpu.session import Session, SessionConfig
from tests.session.oracle import build_model


@pytest.mark.parametrize("accumulate", [1.5, 2.0, "2", True, None, 0, -1])
def test_accumulate_must_be_an_integer_of_at_least_one(accumulate: Any) -> None:
    # 1.5 was accepted and stepped on 4/3 of the mean gradient (backward divided by 1.5, windows of 2)
    with pytest.raises(ConfigError, match=rf"accumulate={accumulate!r} must be an integer >= 1.*e\.g\. accumulate=2"):
        SessionConfig(accumulate=accumulate)


@pytest.mark.parametrize("timeout_s", [math.nan, math.inf, -1.0, 0, "30", True])
def test_timeout_must_be_a_finite_positive_number_of_seconds(timeout_s: Any) -> None:
    with pytest.raises(ConfigError, match=r"timeout_s=.* must be a finite number of seconds > 0, e\.g\. timeout_s=600"):
        SessionConfig(timeout_s=timeout_s)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.0, "0", True, None])
def test_seed_must_be_an_integer_in_range(seed: Any) -> None:
    with pytest.raises(ConfigError, match=rf"seed={seed!r} must be an integer in \[0, 2\*\*63 - 1\]"):
        SessionConfig(seed=seed)


def test_numpy_integers_are_integers() -> None:
    config = SessionConfig(accumulate=np.int64(2), seed=np.int32(7))
    assert (config.accumulate, config.seed) == (2, 7)
    assert type(config.accumulate) is int and type(config.seed) is int


@pytest.mark.parametrize(("field", "value"), [("strategy", 3), ("strategy", ["ddp"]), ("precision", None)])
def test_a_strategy_or_precision_of_another_type_is_a_config_error(field: str, value: Any) -> None:
    # a list as strategy raised "TypeError: unhashable type" from the registry lookup
    with pytest.raises(ConfigError, match=re.escape(f"{field}={value!r} is not one of [")):
        SessionConfig(**{field: value})


def test_run_dir_must_be_a_path() -> None:
    with pytest.raises(ConfigError, match=r"run_dir=3 must be a folder path"):
        SessionConfig(run_dir=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_window_without_backward_changes_nothing_and_says_so(precision: str) -> None:
    with Session(strategy="single", precision=precision) as session:
        model = session.setup_model(build_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with session.micro_step(model):
            model(torch.randn(4, 6))  # a skipped batch: forward, no backward
        assert session.step(optimizer) is False  # it returned True although nothing changed
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), key
        # the window is closed: the next micro-step starts a new one and steps normally
        with session.micro_step(model):  # a small loss: fp16's first scale (65536) must not overflow it
            session.backward(model(torch.randn(4, 6)).float().mean() * 1e-3)
        assert session.step(optimizer) is True
        assert not torch.equal(model[0].weight, before["0.weight"])


def test_max_grad_norm_must_be_a_positive_number() -> None:
    with Session(strategy="single") as session:
        model = session.setup_model(build_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for bad in (math.nan, -1.0, 0.0, "1"):
            with session.micro_step(model):
                session.backward(model(torch.randn(4, 6)).sum())
            with pytest.raises(ConfigError, match=r"max_grad_norm=.* must be a finite number > 0"):
                session.step(optimizer, max_grad_norm=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        (lambda batch: batch[0].tolist(), r"returned a list"),
        (lambda batch: float(batch[0].sum()), r"returned a float"),
        (lambda batch: batch[0].sum(), r"returned a 0-dimensional tensor"),
        (lambda batch: batch[0][:1], r"returned 1 row\(s\) for a batch of 3"),
    ],
)
def test_evaluate_with_a_function_that_does_not_return_per_sample_tensors(fn: Any, says: str) -> None:
    with Session(strategy="single") as session:
        with pytest.raises(ConfigError, match=rf"evaluate's fn {says}.*one row per sample"):
            session.evaluate(fn, TensorDataset(torch.arange(7.0)), batch_size=3)
