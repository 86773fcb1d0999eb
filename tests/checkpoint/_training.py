"""A small real training run (scikit-learn's digits, an MLP with dropout) shared by the resume tests.

Every source of randomness a real loop has is used on purpose -- dropout (torch), input noise
(numpy), a random flip (python) -- so a resume that forgets any generator changes the losses.
The batch order of an epoch is a fixed permutation of (seed, epoch): resuming mid-epoch skips
``data_position["batch"]`` batches of the same permutation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from torch import nn

BATCH = 32
BATCHES_PER_EPOCH = 4


# Worker processes read the digits from a file the test wrote (importing scikit-learn in every
# worker would cost seconds per process start).
DATA_FILE: Path | None = None


@lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    if DATA_FILE is not None:
        saved = safetensors.torch.load_file(str(DATA_FILE))
        return saved["x"], saved["y"]
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


def write_digits(path: Path) -> Path:
    x, y = digits()
    safetensors.torch.save_file({"x": x, "y": y}, str(path))
    return path


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.2), nn.Linear(48, 10))


@dataclass
class Parts:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler


def build_parts(model: nn.Module | None = None) -> Parts:
    model = model if model is not None else build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return Parts(model, optimizer, scheduler, torch.amp.GradScaler("cpu", init_scale=2.0**8))


def seed_everything(seed: int) -> None:
    digits()  # loading (importing scikit-learn) the first time may draw random numbers: do it first
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def batch_indices(step: int, *, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """This rank's sample indices for global step ``step`` (epoch = step // BATCHES_PER_EPOCH)."""
    epoch, batch = divmod(step, BATCHES_PER_EPOCH)
    order = torch.randperm(len(digits()[0]), generator=torch.Generator().manual_seed(1234 + epoch))
    global_batch = order[batch * BATCH : (batch + 1) * BATCH]
    per_rank = BATCH // world_size
    return global_batch[rank * per_rank : (rank + 1) * per_rank]


def train_step(parts: Parts, step: int, *, rank: int = 0, world_size: int = 1) -> float:
    x_all, y_all = digits()
    idx = batch_indices(step, rank=rank, world_size=world_size)
    x = x_all[idx] + torch.from_numpy(np.random.normal(0, 0.05, size=(len(idx), 64)).astype(np.float32))
    if random.random() < 0.5:
        x = x.flip(1)
    parts.optimizer.zero_grad()
    loss = nn.functional.cross_entropy(parts.model(x), y_all[idx])
    parts.scaler.scale(loss).backward()
    parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.scheduler.step()
    return float(loss.detach())
