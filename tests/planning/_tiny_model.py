"""Factories for `multigpu advise --model tests.planning._tiny_model:NAME` in the CLI tests."""

from __future__ import annotations

import torch
from torch import nn


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def build_tokens() -> nn.Module:
    """A token model: its inputs are ids (``--input-dtype long``), not floats."""
    return nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(8 * 16, 4))


def not_a_module() -> int:
    return 3


def raises() -> nn.Module:
    raise RuntimeError("weights file missing")


class _RaisesInProcesses(nn.Module):
    """Trains in one process; under ddp or fsdp (a process group exists) its forward raises."""

    def __init__(self) -> None:
        super().__init__()
        self.body = build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.distributed.is_initialized():
            raise RuntimeError("this model refuses to run in a process group")
        return self.body(x)  # type: ignore[no-any-return]


def fails_in_processes() -> nn.Module:
    """`advise --measure`: single and dp report, ddp fails with the message above."""
    return _RaisesInProcesses()
