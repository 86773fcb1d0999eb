"""Factories for `multigpu advise --model tests.planning._tiny_model:NAME` in the CLI tests."""

from __future__ import annotations

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
