"""What the loop toolkit's gathers cost next to torch's own collectives, side by side on 2 gloo ranks.

    python benchmarks/toolkit_gather.py            # launches itself: multigpu launch --strategy ddp --nproc-per-node 2

Rows (median of ``--repeats`` calls, every rank timing the same calls):

- ``session.gather(t)`` (any first dimension per rank: one small all-gather of the row counts, then
  one of the rows padded to the longest) vs ``dist.all_gather_into_tensor`` (equal shapes only);
- ``session.gather_for_metrics(t)`` (the same, plus the interleave into one-device order) vs ``session.gather``;
- ``session.gather_object(obj)`` (pickled bytes through the same gather) vs ``dist.all_gather_object``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from multigpu.runtime.world import read_launch_env


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (connections, allocations)
    times = []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def worker(repeats: int) -> None:
    from multigpu.session import Session

    with Session(strategy="ddp") as session:
        world = session.world_size
        rows = []
        for n in (1_000, 100_000, 1_000_000):
            t = torch.randn(n // world, 4)
            out = torch.empty(n // world * world, 4)
            plain = _median_ms(lambda t=t, out=out: dist.all_gather_into_tensor(out, t), repeats)
            ours = _median_ms(lambda t=t: session.gather(t), repeats)
            rows.append((f"gather {n}x4 float32", ours, plain, "all_gather_into_tensor"))
            metrics = _median_ms(lambda t=t: session.gather_for_metrics(t), repeats)
            rows.append((f"gather_for_metrics {n}x4", metrics, ours, "session.gather"))
        obj = {"ids": list(range(10_000)), "name": "x" * 1000}
        gathered: list[Any] = [None] * world
        plain_obj = _median_ms(lambda: dist.all_gather_object(gathered, obj), repeats)
        ours_obj = _median_ms(lambda: session.gather_object(obj), repeats)
        rows.append(("gather_object (10k ints)", ours_obj, plain_obj, "dist.all_gather_object"))
        if session.is_main_process:
            print(f"{'call':<28} {'ours ms':>9} {'baseline ms':>12} {'ratio':>6}  baseline")
            for name, mine, base, label in rows:
                print(f"{name:<28} {mine:>9.2f} {base:>12.2f} {mine / base:>6.2f}  {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker or read_launch_env() is not None:
        worker(args.repeats)
        return
    import subprocess

    command = [sys.executable, "-m", "multigpu", "launch", "--strategy", "ddp", "--nproc-per-node", "2"]
    sys.exit(subprocess.call([*command, str(Path(__file__).resolve()), "--worker", "--repeats", str(args.repeats)]))


if __name__ == "__main__":
    main()
