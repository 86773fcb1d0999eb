"""What reading ``session.should_stop`` after every step costs: ddp steps with and without it, side by side.

    python benchmarks/stop_flag_overhead.py                # 2 CPU processes (gloo), 12 blocks of 50 steps
    python benchmarks/stop_flag_overhead.py --blocks 20 --width 512

It launches itself with ``multigpu launch --strategy ddp --nproc-per-node 2``. Each worker trains an MLP
and alternates blocks of steps that read ``should_stop`` after each step with blocks that do not, so
slow phases of a shared machine fall on both (and blocks agreeing with a blocking all-reduce, the
design not taken). Rank 0 prints the median step of each kind, their ratio
(median over block pairs of the per-pair ratio) and the median time of one agreement (one
all-reduce of one number) measured alone.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def worker(blocks: int, steps: int, width: int) -> None:
    from multigpu.runtime.preemption import agree
    from multigpu.session import Session

    with Session(strategy="ddp", seed=0) as session:
        model = session.setup_model(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(32, width), torch.randint(0, 10, (32,))

        def block(read: str) -> float:
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                with session.micro_step(model):
                    session.backward(F.cross_entropy(model(x), y))
                session.step(optimizer)
                if read == "async" and session.should_stop:
                    raise SystemExit("stopped by a signal")
                if read == "blocking" and agree(False):
                    raise SystemExit("stopped by a signal")
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        block("none")  # warm up
        triples = [(block("none"), block("async"), block("blocking")) for _ in range(blocks)]
        pairs = [(a, b) for a, b, _ in triples]
        agreements = []
        for _ in range(200):
            start = time.perf_counter()
            agree(False)
            agreements.append(time.perf_counter() - start)
        if session.is_main_process:
            without = statistics.median(a for a, _ in pairs)
            with_read = statistics.median(b for _, b in pairs)
            ratio = statistics.median(b / a for a, b in pairs)
            print(f"{'step without should_stop':>28}: {without * 1e3:8.3f} ms (median)")
            print(f"{'step reading should_stop':>28}: {with_read * 1e3:8.3f} ms (median)")
            print(f"{'ratio with / without':>28}: {ratio:8.3f}")
            blocking = statistics.median(c / a for a, _, c in triples)
            print(f"{'blocking all-reduce / without':>28}: {blocking:8.3f}")
            print(f"{'one agreement (all-reduce)':>28}: {statistics.median(agreements) * 1e3:8.3f} ms (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12, help="block pairs (with / without) per run")
    parser.add_argument("--steps", type=int, default=50, help="steps per block")
    parser.add_argument("--width", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument("--no-bind-cores", action="store_true", help="pass --no-bind-cores to multigpu launch")
    parser.add_argument("--worker", action="store_true", help="run as a launched worker (internal)")
    args = parser.parse_args()
    if args.worker:
        worker(args.blocks, args.steps, args.width)
        return
    command = [sys.executable, "-m", "multigpu", "launch", "--strategy", "ddp", "--nproc-per-node", "2"]
    command += ["--no-bind-cores"] if args.no_bind_cores else []
    command += [__file__]
    command += ["--worker", "--blocks", str(args.blocks), "--steps", str(args.steps), "--width", str(args.width)]
    raise SystemExit(subprocess.call(command))


if __name__ == "__main__":
    main()
