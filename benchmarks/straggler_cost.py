"""What the step clock and the slow-rank watch cost a ddp step: steps with and without them, side by side.

    python benchmarks/straggler_cost.py                 # 2 CPU processes (gloo), 12 block pairs of 50 steps
    python benchmarks/straggler_cost.py --blocks 20 --width 384

It launches itself with ``multigpu launch --strategy ddp --nproc-per-node 2``. Each worker trains an MLP
(``--width`` sets the step: 128 is about 10 ms on the loaded 2-core CPU) through ``session.batches`` and
alternates blocks of 50 steps with the Session's clock on (it times every batch wait and step, and every
50th step the ranks all-gather their times) with blocks where a stand-in that only hands out the batches
replaces it, in turn the one first and the other, so slow phases of a shared machine fall on both. A
block's figure is its mean step (the exchange falls on one step of each block: a median would hide it);
the ratio is the median over block pairs of the per-pair ratio, with its quartiles. Rank 0 also prints
the parts measured alone: one exchange (the all-gather of the header, wall time), and the clock's own
work per step and the watch's (its statistic every 50th step) in one process (CPU time), and what they
add up to per step.
Target: under 1% of a 10 ms step.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


class _ClockOff:
    """What the Session asks of its clock, doing nothing but handing out the batches (the baseline)."""

    def fetch(self, batches: Iterator[Any], end: Any) -> Any:
        return next(batches, end)

    def handed_out(self, batch: Any) -> None:
        pass

    def micro_step(self) -> None:
        pass

    def optimizer_step(self, strategy: Any, *, joined: bool) -> None:
        pass

    def figures(self, strategy: Any, precision: str) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def _clock_alone_s(repeats: int = 20_000) -> float:
    """CPU seconds of the clock's own work per step in one process (CPU time: on a loaded machine the wall
    time of a loop of microseconds is mostly other jobs' turns): fetch, hand-out, micro-step, optimizer step,
    and the timing of the step's one collective (the backward's all-reduce), which both kinds of block pay."""
    from multigpu.runtime import waits
    from multigpu.session.throughput import Throughput
    from multigpu.strategies import build_strategy

    strategy = build_strategy("single", devices="cpu", timeout_s=60, precision="fp32")
    clock, batch = Throughput(), (torch.zeros(4, 8), torch.zeros(4))
    items = iter([batch] * (repeats + 1))
    began = time.process_time()
    for _ in range(repeats):
        clock.handed_out(clock.fetch(items, None))
        clock.micro_step()
        with waits.timing():
            pass
        clock.optimizer_step(strategy, joined=False)
    return (time.process_time() - began) / repeats


def _watch_alone_s(repeats: int = 20_000) -> float:
    """CPU seconds of the slow-rank watch's own work per step in one process: its bookkeeping at every step, and
    a 50th of its statistic and verdict at a window's end (the exchange between them is measured apart)."""
    from multigpu.runtime import stragglers

    watch = stragglers.StragglerWatch(main=False, window=repeats + 1)  # never reaches its exchange here
    steps = [(0.01 + (i % 7) * 1e-4, 1e-4) for i in range(stragglers.WINDOW_STEPS)]
    began = time.process_time()
    for step in range(1, repeats + 1):
        watch.add(step, compute_s=0.01, data_wait_s=1e-4, wall_s=0.012)
    every_step = (time.process_time() - began) / repeats
    began = time.process_time()
    for _ in range(repeats // stragglers.WINDOW_STEPS):
        own = stragglers.typical_step(steps)
        statistics.median(c for c, _ in steps)  # as the watch's median wall time
        stragglers.compare([own, own], 1, stragglers.WINDOW_STEPS)
    window_end = (time.process_time() - began) / (repeats // stragglers.WINDOW_STEPS)
    return every_step + window_end / stragglers.WINDOW_STEPS


def worker(blocks: int, steps: int, width: int) -> None:
    from multigpu.runtime import collectives, stragglers
    from multigpu.session import Session

    with Session(strategy="ddp", seed=0) as session:
        model = session.setup_model(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = [(torch.randn(64, width), torch.randint(0, 10, (64,)))] * steps
        clock_on, clock_off = session._throughput, _ClockOff()

        def block(on: bool) -> float:
            session._throughput = clock_on if on else clock_off  # type: ignore[assignment]
            began = time.perf_counter()
            for x, y in session.batches(batches):
                with session.micro_step(model):
                    session.backward(F.cross_entropy(model(x), y))
                session.step(optimizer)
            return (time.perf_counter() - began) / steps

        block(True)  # warm up (and the clock's untimed first step)
        pairs = []  # (without, with); in turn without first and with first, so a drift of the load falls on both
        for i in range(blocks):
            first = block(i % 2 == 1)
            pairs.append((first, block(True)) if i % 2 == 0 else (block(False), first))
        session._throughput = clock_on
        exchanges = []
        for _ in range(200):
            collectives.barrier()  # in a step the ranks arrive together: DDP's all-reduce has just met them
            began = time.perf_counter()
            collectives.agree(stragglers._CALL, [0, 0])
            exchanges.append(time.perf_counter() - began)
        if session.is_main_process:
            without = statistics.median(a for a, _ in pairs)
            ratios = [b / a for a, b in pairs]
            ratio, quartiles = statistics.median(ratios), statistics.quantiles(ratios, n=4)
            exchange = statistics.median(exchanges)
            alone, watch = _clock_alone_s(), _watch_alone_s()
            print(f"{'step without the clock':>34}: {without * 1e3:8.3f} ms (median of block means)")
            print(f"{'step with the clock':>34}: {statistics.median(b for _, b in pairs) * 1e3:8.3f} ms")
            print(
                f"{'ratio with / without':>34}: {ratio:8.4f} (median over {blocks} block pairs; "
                f"quartiles {quartiles[0]:.4f}-{quartiles[2]:.4f})"
            )
            print(f"{'one exchange (all-gather)':>34}: {exchange * 1e3:8.3f} ms (median of 200, after a barrier)")
            print(f"{'the clock per step, one process':>34}: {alone * 1e6:8.2f} us")
            print(f"{'the watch per step, one process':>34}: {watch * 1e6:8.2f} us (its statistic every 50th)")
            per_step = alone + watch + exchange / stragglers.WINDOW_STEPS
            print(f"{'parts per step / step':>34}: {per_step / without:8.4%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12, help="block pairs (with / without) per run")
    parser.add_argument("--steps", type=int, default=50, help="steps per block")
    parser.add_argument("--width", type=int, default=512, help="the MLP's hidden width (sets the step time)")
    parser.add_argument("--worker", action="store_true", help="run as a launched worker (internal)")
    args = parser.parse_args()
    if args.worker:
        worker(args.blocks, args.steps, args.width)
        return
    command = [sys.executable, "-m", "multigpu", "launch", "--strategy", "ddp", "--nproc-per-node", "2", __file__]
    command += ["--worker", "--blocks", str(args.blocks), "--steps", str(args.steps), "--width", str(args.width)]
    raise SystemExit(subprocess.call(command))


if __name__ == "__main__":
    main()
