"""Launch and per-step overhead of `multigpu launch` (ddp) vs plain torchrun + DDP vs `accelerate launch`.

    pip install -e '.[bench]'                       # Hugging Face Accelerate, for the comparison
    python benchmarks/launch_overhead.py             # 2 CPU processes, 5 repeats, table + PNG
    python benchmarks/launch_overhead.py --repeats 5 --steps 300

The same model (an MLP), the same global batch and the same data run under three launchers, two
processes each on the CPU (gloo), with the same OMP_NUM_THREADS:

- ``torchrun``: a script written directly against torch.distributed and DistributedDataParallel;
- ``multigpu``: ``multigpu launch --strategy ddp`` running the Session API loop;
- ``accelerate``: ``accelerate launch`` running Accelerate's documented loop.

Each worker times every step on rank 0 (from the end of one step to the end of the next, so fetching
the batch counts); the run's figure is the median step. Launchers alternate within each repeat and
the table shows the median over repeats, the spread, and the median of the per-repeat ratios. Targets: multigpu
within 2% of torchrun and no slower than Accelerate. This file is also the worker (``--worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LAUNCHERS = ("torchrun", "multigpu", "accelerate")
NPROC = 2


# -- the workers: one training loop per launcher, identical model, data and step ---------------------


def _model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _shard(rank: int, world: int, global_batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's part of ``count`` fixed global batches (the same data for every launcher)."""
    gen = torch.Generator().manual_seed(0)
    per = global_batch // world
    out = []
    for _ in range(count):
        x, y = torch.randn(global_batch, 256, generator=gen), torch.randint(0, 10, (global_batch,), generator=gen)
        out.append((x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
    return out


def _timed(ends: list[float], warmup: int) -> float:
    steps = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :])]
    return 1000.0 * statistics.median(steps)


def _worker_torchrun(args: argparse.Namespace) -> tuple[int, float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(_model(args.hidden))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pool = _shard(rank, world, args.global_batch, 8)
    ends = [time.perf_counter()]
    for step in range(args.warmup + args.steps):
        x, y = pool[step % len(pool)]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    dist.destroy_process_group()
    return rank, _timed(ends, args.warmup)


def _worker_multigpu(args: argparse.Namespace) -> tuple[int, float]:
    from multigpu.session import Session

    with Session(strategy="ddp") as session:
        model = session.setup_model(_model(args.hidden))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        pool = _shard(session.global_rank, session.world_size, args.global_batch, 8)
        batches = [pool[step % len(pool)] for step in range(args.warmup + args.steps)]
        ends = [time.perf_counter()]
        for x, y in session.batches(batches):
            with session.micro_step(model):
                loss = F.cross_entropy(model(x), y)
                session.backward(loss)
            session.step(optimizer)
            ends.append(time.perf_counter())
        return session.global_rank, _timed(ends, args.warmup)


def _worker_accelerate(args: argparse.Namespace) -> tuple[int, float]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = _model(args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    pool = _shard(accelerator.process_index, accelerator.num_processes, args.global_batch, 8)
    ends = [time.perf_counter()]
    for step in range(args.warmup + args.steps):
        x, y = pool[step % len(pool)]
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    accelerator.end_training()
    return accelerator.process_index, _timed(ends, args.warmup)


WORKERS = {"torchrun": _worker_torchrun, "multigpu": _worker_multigpu, "accelerate": _worker_accelerate}


def run_worker(args: argparse.Namespace) -> None:
    rank, ms = WORKERS[args.worker](args)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"ms_per_step": ms}))


# -- the orchestrator ------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_command(launcher: str, worker_args: list[str]) -> list[str]:
    """The command line each launcher is started with (two processes on this node)."""
    me = str(Path(__file__).resolve())
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC),
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), me, *worker_args]  # fmt: skip
    if launcher == "multigpu":
        return [sys.executable, "-m", "multigpu", "launch", "--strategy", "ddp", "--nproc-per-node", str(NPROC), me, *worker_args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(NPROC),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(_free_port()), me, *worker_args]  # fmt: skip


def run_once(launcher: str, args: argparse.Namespace, out_dir: Path, env: dict[str, str]) -> dict[str, float]:
    result = out_dir / f"{launcher}.json"
    result.unlink(missing_ok=True)
    worker_args = ["--worker", launcher, "--result", str(result), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--global-batch", str(args.global_batch), "--hidden", str(args.hidden)]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(launch_command(launcher, worker_args), env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0 or not result.exists():
        raise SystemExit(f"{launcher} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {"ms_per_step": json.loads(result.read_text())["ms_per_step"], "wall_s": wall}


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    from rich.progress import Progress

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // NPROC)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # the same thread count under every launcher
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.launchers}
    with Progress() as progress:
        task = progress.add_task("launching", total=args.repeats * len(args.launchers))
        for repeat in range(args.repeats):
            order = args.launchers if repeat % 2 == 0 else args.launchers[::-1]  # alternate: drift hits all
            for launcher in order:
                progress.update(task, description=f"repeat {repeat + 1}: {launcher}")
                runs[launcher].append(run_once(launcher, args, out_dir, env))
                progress.advance(task)
    return runs


def paired_ratio(runs: dict[str, list[dict[str, float]]], name: str, base: str) -> float:
    """Median over repeats of ``name``'s step time / ``base``'s in the same repeat (runs back to back,
    so load from other jobs on the machine mostly cancels)."""
    pairs = zip(runs[name], runs[base])
    return statistics.median(a["ms_per_step"] / b["ms_per_step"] for a, b in pairs)


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    med = {name: statistics.median(r["ms_per_step"] for r in rs) for name, rs in runs.items()}
    table = Table(title=f"DDP on {NPROC} CPU processes (gloo): global batch {args.global_batch}, "
                  f"median of {args.steps} steps per run, {args.repeats} repeats")  # fmt: skip
    for col in ("launcher", "ms/step (median)", "best", "worst", "vs torchrun", "vs accelerate", "launch wall s"):
        table.add_column(col, justify="left" if col == "launcher" else "right")
    for name, rs in runs.items():
        steps = [r["ms_per_step"] for r in rs]
        table.add_row(
            name,
            f"{med[name]:.2f}",
            f"{min(steps):.2f}",
            f"{max(steps):.2f}",
            f"{paired_ratio(runs, name, 'torchrun'):.3f}" if "torchrun" in runs else "-",
            f"{paired_ratio(runs, name, 'accelerate'):.3f}" if "accelerate" in runs else "-",
            f"{statistics.median(r['wall_s'] for r in rs):.1f}",
        )
    console = Console(width=120)
    console.print(table)
    console.print("ratios: median over repeats of the per-repeat ratio (launchers run back to back in each repeat)")
    for base, target in (("torchrun", 1.02), ("accelerate", 1.0)):
        if "multigpu" in runs and base in runs:
            ratio = paired_ratio(runs, "multigpu", base)
            console.print(f"multigpu / {base} = {ratio:.3f} (target <= {target:.2f}): {'met' if ratio <= target else 'NOT met'}")
    _figure(med, runs, Path(args.out_dir) / "launch_overhead.png")
    console.print(f"figure: {Path(args.out_dir) / 'launch_overhead.png'}")


def _figure(med: dict[str, float], runs: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(med)
    ax.bar(names, [med[n] for n in names], color=["#888888", "#2a7ab9", "#e39b2d"][: len(names)])
    for i, name in enumerate(names):
        ax.scatter([i] * len(runs[name]), [r["ms_per_step"] for r in runs[name]], color="black", s=10, zorder=3)
    ax.set_ylabel("ms per step (median; dots: repeats)")
    ax.set_title(f"DDP step time, {NPROC} CPU processes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--global-batch", type=int, default=256, help="samples per step over both processes")
    parser.add_argument("--hidden", type=int, default=512, help="MLP width")
    parser.add_argument("--repeats", type=int, default=5, help="runs per launcher (median reported)")
    parser.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=LAUNCHERS)
    parser.add_argument("--timeout", type=float, default=300, help="seconds before one run is killed")
    parser.add_argument("--out-dir", default="out/bench", help="where the PNG and per-run results go")
    parser.add_argument("--worker", choices=LAUNCHERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    if "accelerate" in args.launchers:
        try:
            import accelerate  # noqa: F401
        except ImportError:
            raise SystemExit("Accelerate is not installed: pip install -e '.[bench]' (or pass --launchers torchrun multigpu)")
    report(measure(args), args)


if __name__ == "__main__":
    main()
