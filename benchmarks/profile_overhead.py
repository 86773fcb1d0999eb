"""Overhead of the step profiler on a real DataParallel training step (target: off ~0, on <= 3%).

    .venv/bin/python benchmarks/profile_overhead.py            # cpu:2, two model sizes
    .venv/bin/python benchmarks/profile_overhead.py --rounds 21 --steps 30

"off": the engine as shipped; its phase marks run with no listener attached. Their cost is
measured directly (a no-listener ``Listeners.phase`` call, times the phases one step opens)
because it cannot be switched off to compare against. "on": the same steps inside
``profile_steps(model, ...)`` (phase timing, byte counting, optimizer hooks). Two estimates of the
on-cost:

* A/B: off and on alternate in short blocks of --steps; the ratio is the median over --rounds of
  on/off of adjacent blocks (paired, so load from other processes hits both sides alike).
* direct: the profiler's added work per step timed on its own (a listened phase minus an idle
  one, times the phases per step; plus the parameter-byte walks the engine does when profiled),
  over the step time. Stable on a busy machine where the A/B ratio is noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import multigpu
from multigpu.core.listeners import Listeners
from multigpu.profiling.step import ProfileConfig, StepProfiler, profile_steps


def _model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def _block(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / steps


def measure(width: int, batch: int, devices: str, steps: int, rounds: int) -> tuple[float, float, float, int, float]:
    """Median step seconds off and on, the paired on/off ratio, phases per step, seconds per parameter walk."""
    torch.manual_seed(0)
    net = _model(width)
    model = multigpu.DataParallel(net, devices=devices)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    _block(model, opt, x, y, steps)  # warm-up: threads, allocator
    off, on = [], []
    phases_per_step = 0
    for i in range(rounds):
        if i % 2:  # alternate which side goes first
            off.append(_block(model, opt, x, y, steps))
        with profile_steps(model, optimizer=opt, config=ProfileConfig(warmup=0)) as prof:
            on.append(_block(model, opt, x, y, steps))
        if not i % 2:
            off.append(_block(model, opt, x, y, steps))
        phases_per_step = sum(p.calls for p in prof.profile().steps[0].phases)
    ratio = statistics.median(a / b for a, b in zip(on, off))
    walks = 2000
    start = time.perf_counter()
    for _ in range(walks):
        sum(p.numel() * p.element_size() for p in net.parameters())
    walk = (time.perf_counter() - start) / walks
    return statistics.median(off), statistics.median(on), ratio, phases_per_step, walk


def phase_cost(listening: bool, calls: int = 100_000) -> float:
    """Seconds per ``with listeners.phase(...)`` block, with or without a step profiler attached."""
    listeners, profiler = Listeners(), StepProfiler(ProfileConfig(warmup=0))
    with listeners.add(profiler) if listening else contextlib.nullcontext():
        start = time.perf_counter()
        for i in range(calls):
            with listeners.phase("forward", "cpu:0"):
                pass
            if listening and i % 20 == 19:
                profiler.step()  # a step closes every ~20 phases, as in training
        return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="cpu:2")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--rounds", type=int, default=41, help="off/on block pairs; medians are reported")
    args = parser.parse_args()
    idle = statistics.median(phase_cost(False) for _ in range(3))
    listened = statistics.median(phase_cost(True) for _ in range(3))
    replicas = len(multigpu.parse_devices(args.devices))
    table = Table(title=f"Step profiler overhead on DataParallel({args.devices}), median of {args.rounds} block pairs")
    for column in ("model", "step ms off", "step ms on", "A/B on/off", "on: direct", "off: idle marks"):
        table.add_column(column, justify="right")
    for width, batch in ((128, 64), (512, 256)):
        off, on, ratio, count, walk = measure(width, batch, args.devices, args.steps, args.rounds)
        direct = count * (listened - idle) + (1 + replicas) * walk
        table.add_row(
            f"MLP {width}, batch {batch}",
            f"{off * 1e3:.3f}",
            f"{on * 1e3:.3f}",
            f"{ratio:.3f}",
            f"+{100 * direct / off:.2f}%",
            f"{count} x {idle * 1e9:.0f} ns = {100 * count * idle / off:.3f}%",
        )
    Console(width=130).print(table)
    print(f"phase mark: {idle * 1e9:.0f} ns idle, {listened * 1e9:.0f} ns with the step profiler listening")


if __name__ == "__main__":
    main()
