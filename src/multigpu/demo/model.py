"""The demo's model: a small CNN for 8x8 digit images (no BatchNorm, so that one device and
several replicas see exactly the same function of the batch)."""

from __future__ import annotations

from torch import nn


def build_cnn(width: int = 32, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 16, 128),
        nn.ReLU(),
        nn.Linear(128, classes),
    )
