"""Models whose weights say which save they came from: every parameter holds one value."""

from __future__ import annotations

import torch
from torch import nn


def filled(value: float) -> nn.Module:
    """A Linear(3, 2) with every weight and bias equal to ``value``."""
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model
