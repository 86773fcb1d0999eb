"""An int past the largest float (10**400) where a number is taken: refused by name, or read as infinity, never
Python's OverflowError from float() (launch_function's timeout, Session's timeout_s, session.step's max_grad_norm,
a logged metric, measure's budget: tests/launcher/test_measure.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import multigpu
from multigpu.core.limits import to_float
from multigpu.errors import ConfigError
from multigpu.session import Session

HUGE = 10**400


def test_to_float_reads_an_int_past_the_largest_float_as_an_infinity_of_its_sign() -> None:
    assert to_float(HUGE) == math.inf and to_float(-HUGE) == -math.inf and to_float(3) == 3.0


def test_launch_functions_timeout_refuses_it_by_name() -> None:
    with pytest.raises(ConfigError, match=r"timeout=1000.*a finite number > 0"):
        multigpu.launch_function(print, timeout=HUGE)


def test_a_sessions_timeout_refuses_it_by_name() -> None:
    with pytest.raises(ConfigError, match="timeout_s"):
        Session(strategy="single", timeout_s=HUGE)


def test_max_grad_norm_refuses_it_by_name_and_a_metric_logs_it_as_infinity(tmp_path: Path) -> None:
    with Session(strategy="single", trackers=("csv",), run_dir=tmp_path) as session:
        model = session.setup_model(torch.nn.Linear(2, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with session.micro_step(model):
            session.backward(model(torch.ones(3, 2)).sum())
        with pytest.raises(ConfigError, match=r"max_grad_norm=1000.* must be a finite number > 0"):
            session.step(optimizer, max_grad_norm=HUGE)
        session.log({"big": HUGE, "small": -HUGE}, 1)
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert any(",big,inf," in row for row in rows) and any(",small,-inf," in row for row in rows)
