"""Fixtures of the tests that need a GPU (every test here is marked ``cuda``; see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=["one-gpu", "every-gpu"])
def gpu_ids(request: pytest.FixtureRequest) -> list[int]:
    """``[0]``, then every visible GPU (that case needs two: with one it would repeat the first)."""
    if request.param == "one-gpu":
        return [0]
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs 2 GPUs to split a batch across; this machine has {count}")
    return list(range(count))


def tolerance(gpu_ids: list[int], **split: float) -> dict[str, float]:
    """Bitwise on one GPU (the same kernels on the same shapes as the bare module); ``split`` when the
    batch is split (each replica's partial sums round on their own)."""
    return {"rtol": 0.0, "atol": 0.0} if len(gpu_ids) == 1 else split
