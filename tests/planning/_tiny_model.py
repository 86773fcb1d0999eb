"""A factory for `multigpu advise --model tests.planning._tiny_model:build` in the CLI tests."""

from __future__ import annotations

from torch import nn


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def not_a_module() -> int:
    return 3
