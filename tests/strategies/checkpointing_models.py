"""A small transformer-like model for the activation-checkpointing tests: blocks of attention and an MLP, with dropout."""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 32


class Block(nn.Module):
    """A pre-norm transformer block (self-attention, then an MLP), each branch with dropout."""

    def __init__(self, width: int = WIDTH, dropout: float = 0.2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self, blocks: int = 3, width: int = WIDTH, dropout: float = 0.2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_net(seed: int = 0, **kwargs: int | float) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)  # type: ignore[arg-type]


def inputs(batch: int = 4, length: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, length, WIDTH, generator=torch.Generator().manual_seed(seed))
