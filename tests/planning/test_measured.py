"""Predicted vs measured step time on this CPU, within 25%: DataParallel "cpu:2" and 2-process DDP.

Each real step is predicted from a calibration taken right before it (one replica alone, the
replicas at once, an all-reduce); the median over the pairs of predicted / measured is checked
(see tests/planning/_measured.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port
from tests.planning import _measured


@pytest.fixture
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per replica, as the DDP processes use
    yield
    torch.set_num_threads(previous)


def test_dataparallel_cpu2_step_time_within_25_percent(one_thread: None) -> None:
    pairs = _measured.dataparallel_check(_measured.ITERATIONS)
    ratio = _measured.median_ratio(pairs)
    assert 0.75 <= ratio <= 1.25, f"median predicted/measured {ratio:.2f}; pairs (s): {pairs}"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ddp_two_gloo_processes_step_time_within_25_percent(tmp_path: Path) -> None:
    pairs = _measured.ddp_check(free_port(), str(tmp_path), _measured.ITERATIONS, timeout_s=90.0)
    ratio = _measured.median_ratio(pairs)
    assert 0.75 <= ratio <= 1.25, f"median predicted/measured {ratio:.2f}; pairs (s): {pairs}"
