"""The one-device oracle for the fsdp and DDP-option workers: any model, optimizer, clipping, BatchNorm.

Same batches as the Session's loader (torch's DistributedSampler with one replica, seed 0); with
accumulation, one step per ``accumulate`` consecutive global batches on their concatenation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class Block(nn.Module):
    """A residual MLP block: the unit a user names in ``FSDPOptions(wrap=[Block])``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


def deep_model() -> nn.Module:
    """Nested: two Blocks between an input and an output layer (several FSDP groups by default)."""
    return nn.Sequential(nn.Linear(6, 8), Block(8), Block(8), nn.Linear(8, 2))


def batchnorm_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


class Branchy(nn.Module):
    """A model with a branch its forward never takes: DDP's "unused parameters" case."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        self.unused = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2)


def one_device_train(
    dataset: TensorDataset,
    build: Callable[[], nn.Module],
    make_optimizer: OptimizerFactory,
    *,
    global_batch: int = 8,
    accumulate: int = 1,
    max_grad_norm: float | None = None,
    epochs: int = 2,
) -> nn.Module:
    """``epochs`` of training on one device over the Session's global batches (MSE loss)."""
    torch.manual_seed(0)
    model = build()
    optimizer = make_optimizer(list(model.parameters()))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)  # type: ignore[arg-type]
    window = global_batch * accumulate
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        usable = len(order) - len(order) % global_batch
        for start in range(0, usable, window):
            x, y = dataset[order[start : min(start + window, usable)]]
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
    return model


def assert_weights_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float, rtol: float = 1e-5
) -> None:
    """Same keys in the same order, and every tensor within the tolerance (the key names the miss)."""
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=rtol, atol=atol, msg=key)


def max_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over every tensor of ``want``."""
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
