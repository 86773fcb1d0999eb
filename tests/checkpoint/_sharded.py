"""Training under fsdp for the sharded-checkpoint tests: the digits MLP of :mod:`_training`, sharded by FSDP2.

The step uses every source of randomness a real loop has (dropout, numpy noise, a python flip:
each rank its own streams), AdamW (per-parameter state and a step counter) and StepLR, so a
resume that misses any part of the state changes the weights. Each rank trains on its share
of the global batch of :func:`_training.batch_indices`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from multigpu.strategies.fsdp import FSDPOptions, apply_fsdp
from tests.checkpoint import _training as tr


@dataclass
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def build_run(model: nn.Module) -> Run:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    return Run(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5))


def sharded_model() -> nn.Module:
    """The digits MLP (same initial weights everywhere), each Linear its own FSDP group, then the root."""
    return apply_fsdp(tr.build_model(), torch.device("cpu"), FSDPOptions(), "fp32")


def train_step(run: Run, step: int, *, rank: int = 0, world_size: int = 1) -> float:
    x_all, y_all = tr.digits()
    idx = tr.batch_indices(step, rank=rank, world_size=world_size)
    x = x_all[idx] + torch.from_numpy(np.random.normal(0, 0.05, size=(len(idx), 64)).astype(np.float32))
    if random.random() < 0.5:
        x = x.flip(1)
    run.optimizer.zero_grad()
    loss = nn.functional.cross_entropy(run.model(x), y_all[idx])
    loss.backward()
    run.optimizer.step()
    run.scheduler.step()
    return float(loss.detach())


def local(value: object) -> object:
    """``value`` with every DTensor replaced by this rank's slice (a plain tensor), recursively."""
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local(v) for v in value)
    return value


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights (a collective under fsdp: each DTensor gathered)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def random_draws() -> dict[str, object]:
    """One draw from each generator: equal draws mean equal random states."""
    return {"torch": torch.rand(3), "numpy": float(np.random.rand()), "python": random.random()}
