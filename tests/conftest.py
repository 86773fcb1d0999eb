"""Shared fixtures. The oracle everywhere is plain PyTorch on one device."""

from __future__ import annotations

import socket

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        # The marker, not the keyword: every name on a test's path is a keyword (the tests/cuda/ folder,
        # a parametrize id), and only tests marked `cuda` run in ./scripts/gpu-check (pytest -m cuda).
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
