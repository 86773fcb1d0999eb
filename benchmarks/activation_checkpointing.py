"""Peak activation memory and step time with and without activation checkpointing, in one run, on the CPU.

    python benchmarks/activation_checkpointing.py                  # 12 blocks, 3 alternating rounds
    python benchmarks/activation_checkpointing.py --rounds 5 --width 128 --batch 8

The model is a 12-block pre-norm transformer (self-attention and a 4x MLP per block, dropout 0.1)
trained through the Session on one device, ``Session(activation_checkpointing=[Block])`` against
the same Session without it, same seed and data. Goal: activation memory down at least 40% for at
most 1.35x the step time.

How memory is measured: the project's allocation tracker (``multigpu.track_memory``, a dispatch
mode that sees every storage the step allocates until it is freed) over forward and backward; the
figure is its peak above the resident parameters, minus the bytes of the gradients backward
creates (the same with and without): what the activations (and their recomputation) hold at the
peak. Step time is forward, backward and an AdamW step, without the tracker, median over rounds
whose order alternates.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import time
from typing import Any

import torch
from torch import nn

import multigpu
from multigpu.session import Session


class Block(nn.Module):
    """Pre-norm block: causal self-attention (eager softmax, as GPT-2's), then a 4x MLP; dropout on both."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        attention = self.drop(scores.masked_fill(mask, float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((attention @ v).transpose(1, 2).reshape(batch, length, width)))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, blocks: int, width: int, heads: int, vocab: int = 1000, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(blocks))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def measure(args: argparse.Namespace, checkpointed: bool) -> dict[str, Any]:
    """One configuration: activation bytes at the peak, and the median of ``args.steps`` step times."""
    with Session(strategy="single", seed=0, activation_checkpointing=[Block] if checkpointed else None) as session:
        model = session.setup_model(Transformer(args.blocks, args.width, args.heads))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, 1000, (args.batch, args.length + 1), generator=torch.Generator().manual_seed(0))
        x, y = tokens[:, :-1], tokens[:, 1:]

        def step() -> None:
            with session.micro_step(model):
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
                session.backward(loss, num_items=y.numel())
            session.step(optimizer)

        step()  # warm-up: optimizer state, thread pools
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        with multigpu.track_memory(model) as memory:
            with session.micro_step(model):
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
                session.backward(loss, num_items=y.numel())
        result = memory.results()[0]
        gradients = sum(p.numel() * p.element_size() for p in model.parameters())
        optimizer.zero_grad(set_to_none=True)
        return {"activations": result.peak - result.resident - gradients, "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration and round")
    args = parser.parse_args()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{args.blocks} blocks, width {args.width}, batch {args.batch} x {args.length} tokens; revision {revision}")
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for checkpointed in (False, True) if round_ % 2 == 0 else (True, False):
            runs[checkpointed].append(measure(args, checkpointed))
    plain_mem, ckpt_mem = (statistics.median(r["activations"] for r in runs[c]) for c in (False, True))
    plain_time = statistics.median(r["step_s"] for r in runs[False])
    ckpt_time = statistics.median(r["step_s"] for r in runs[True])
    print("| configuration | activation memory at the peak | step (median) |")
    print("|---|---|---|")
    print(f"| without | {plain_mem / 2**20:.1f} MiB | {plain_time * 1e3:.0f} ms |")
    print(f"| activation_checkpointing=[Block] | {ckpt_mem / 2**20:.1f} MiB | {ckpt_time * 1e3:.0f} ms |")
    saved = 1 - ckpt_mem / plain_mem
    ratio = ckpt_time / plain_time
    print(f"activation memory down {saved:.0%} (goal >= 40%); step time {ratio:.2f}x (goal <= 1.35x)")


if __name__ == "__main__":
    main()
