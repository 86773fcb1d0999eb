"""The oracle: plain PyTorch on one device, same seed, same global batches (shared with ddp_worker.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def regression_data(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=gen)
    y = x[:, :2] * 0.5 - x[:, 2:4] + 0.1 * torch.randn(n, 2, generator=gen)
    return TensorDataset(x, y)


def plain_train(dataset: TensorDataset, *, global_batch: int, accumulate: int = 1, lr: float = 0.2) -> nn.Module:
    """Two epochs of SGD over the session's global batches, with a plain loop on one device.

    Batch order: torch's DistributedSampler with one replica (the permutation every rank shares);
    with accumulation, one step per ``accumulate`` consecutive batches on their concatenation, the
    epoch's last window on whatever batches remain.
    """
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)  # type: ignore[arg-type]
    window = global_batch * accumulate
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        usable = len(order) - len(order) % global_batch
        for start in range(0, usable, window):
            x, y = dataset[order[start : min(start + window, usable)]]
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    return model
