"""Launch and per-step overhead of `multigpu launch` (ddp) vs plain torchrun + DDP vs `accelerate launch`.

    pip install -e '.[bench]'                       # Hugging Face Accelerate, for the comparison
    python benchmarks/launch_overhead.py             # 2 CPU processes, 9 repeats of 1000 steps: table + PNG
    python benchmarks/launch_overhead.py --repeats 15 --launchers torchrun multigpu

The same model (an MLP), the same global batch and the same data run under four launch setups, two
processes each on the CPU (gloo), with the same OMP_NUM_THREADS:

- ``torchrun``: a script written directly against torch.distributed and DistributedDataParallel;
- ``multigpu``: ``multigpu launch --strategy ddp`` running the Session API loop (workers bound to
  their own cores, the launcher's CPU default);
- ``multigpu-unbound``: the same with ``--no-bind-cores``, so the launcher's and the API's own
  overhead shows without the binding's gain;
- ``multigpu-debug``: ``multigpu launch --debug``: every collective first exchanges a fingerprint
  and torch runs with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (its cost, against ``multigpu``);
- ``accelerate``: ``accelerate launch`` running Accelerate's documented loop.

It also prints what each collective's entry in the per-rank ledger costs (the part of the hang
forensics that is always on), measured in one process.

Each worker times every step on rank 0 (from the end of one step to the end of the next, so fetching
the batch counts); a run's figures are its median step, its mean step (the throughput) and its 10th
percentile. Launchers alternate within each repeat; a ratio is the median over repeats of the
per-repeat ratio (the runs of one repeat are back to back, so slow phases of the machine mostly
cancel), shown with a bootstrap 90% interval: when the interval straddles a target, the machine's
noise is larger than the difference and more ``--repeats`` resolve it. Targets: multigpu within 2%
of torchrun and no slower than Accelerate. This file is also the worker (``--worker``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

LAUNCHERS = ("torchrun", "multigpu", "multigpu-unbound", "multigpu-debug", "accelerate")
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


def _timed(ends: list[float], warmup: int) -> dict[str, float]:
    """Median, mean and 10th-percentile step time in ms (p10: the steps other jobs on the machine slowed least)."""
    steps = sorted(1000.0 * (b - a) for a, b in zip(ends[warmup:], ends[warmup + 1 :]))
    return {"ms_per_step": statistics.median(steps), "mean": statistics.fmean(steps), "p10": steps[len(steps) // 10]}


def _worker_torchrun(args: argparse.Namespace) -> tuple[int, dict[str, float]]:
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
    # Free DDP's reducer before the group goes: destroying a gloo group under a live reducer
    # aborted a worker at exit twice in about fifteen runs here (pytorch#190489).
    dist.barrier()
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return rank, _timed(ends, args.warmup)


def _worker_multigpu(args: argparse.Namespace) -> tuple[int, dict[str, float]]:
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


def _worker_accelerate(args: argparse.Namespace) -> tuple[int, dict[str, float]]:
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
    rank = accelerator.process_index
    del model, optimizer  # as in the torchrun worker: no live reducer when the group goes
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()
    return rank, _timed(ends, args.warmup)


WORKERS = {
    "torchrun": _worker_torchrun,
    "multigpu": _worker_multigpu,
    "multigpu-unbound": _worker_multigpu,
    "multigpu-debug": _worker_multigpu,
    "accelerate": _worker_accelerate,
}


def run_worker(args: argparse.Namespace) -> None:
    rank, timing = WORKERS[args.worker](args)
    if rank == 0:
        Path(args.result).write_text(json.dumps(timing))


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
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(NPROC),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            me,
            *worker_args,
        ]
    if launcher.startswith("multigpu"):
        unbound = {"multigpu-unbound": ["--no-bind-cores"], "multigpu-debug": ["--debug"]}.get(launcher, [])
        return [
            sys.executable,
            "-m",
            "multigpu",
            "launch",
            "--strategy",
            "ddp",
            "--nproc-per-node",
            str(NPROC),
            *unbound,
            me,
            *worker_args,
        ]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(NPROC),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        me,
        *worker_args,
    ]


def run_once(launcher: str, args: argparse.Namespace, out_dir: Path, env: dict[str, str]) -> dict[str, float]:
    result = out_dir / f"{launcher}.json"
    result.unlink(missing_ok=True)
    worker_args = [
        "--worker",
        launcher,
        "--result",
        str(result),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--global-batch",
        str(args.global_batch),
        "--hidden",
        str(args.hidden),
    ]
    start = time.perf_counter()
    done = subprocess.run(
        launch_command(launcher, worker_args), env=env, capture_output=True, text=True, timeout=args.timeout
    )
    wall = time.perf_counter() - start
    if done.returncode != 0 or not result.exists():
        raise SystemExit(f"{launcher} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {**json.loads(result.read_text()), "wall_s": wall}


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
    (out_dir / "runs.json").write_text(json.dumps(runs, indent=1))  # every repeat's figures, to pool runs later
    return runs


def api_overhead_us(steps: int = 3000, repeats: int = 7) -> dict[str, float]:
    """What the Session loop adds to a plain loop per step, in one process, on a tiny model.

    Alternates the two loops and keeps each one's fastest repeat, so load from other jobs cancels;
    this is the launcher-independent part of the per-step difference.
    """
    from multigpu.session import Session

    model, x, y = nn.Linear(8, 4), torch.randn(16, 8), torch.randint(0, 4, (16,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def plain() -> float:
        start = time.perf_counter()
        for xb, yb in [(x, y)] * steps:
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def session_loop(session: Session, wrapped: nn.Module) -> float:
        start = time.perf_counter()
        for xb, yb in session.batches([(x, y)] * steps):
            with session.micro_step(wrapped):
                session.backward(F.cross_entropy(wrapped(xb), yb))
            session.step(optimizer)
        return time.perf_counter() - start

    with Session(strategy="single") as session:
        wrapped = session.setup_model(model)
        best = {"plain_us": float("inf"), "session_us": float("inf")}
        for _ in range(repeats):
            best["plain_us"] = min(best["plain_us"], 1e6 * plain() / steps)
            best["session_us"] = min(best["session_us"], 1e6 * session_loop(session, wrapped) / steps)
    return best


def ledger_overhead_us(calls: int = 20000, repeats: int = 7) -> dict[str, float]:
    """Microseconds one collective's ledger entry costs (count, call site, memory-mapped write), in one process.

    ``off``: outside a launch (no ledger file: count and call site only); ``on``: with the file, as
    every worker of ``multigpu launch`` keeps it. Fastest of ``repeats``.
    """
    import tempfile

    from multigpu.runtime import tracking

    best = {"off": float("inf"), "on": float("inf")}
    with tempfile.TemporaryDirectory() as folder:
        for label, env in (("off", {}), ("on", {"MULTIGPU_FAILURE_DIR": folder, "RANK": "0", "WORLD_SIZE": "1"})):
            saved = dict(os.environ)
            os.environ.update(env)
            tracking._ledger = tracking._Ledger()  # a fresh ledger that reads this environment
            try:
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(calls):
                        tracking.enter("reduce (mean)")
                    best[label] = min(best[label], 1e6 * (time.perf_counter() - start) / calls)
            finally:
                os.environ.clear()
                os.environ.update(saved)
                tracking._ledger = tracking._Ledger()
    return best


STATISTICS = {"ms_per_step": "median step", "mean": "mean step", "p10": "p10 step"}
TARGETS = (
    ("multigpu", "torchrun", 1.02),
    ("multigpu", "accelerate", 1.0),
    ("multigpu-unbound", "torchrun", 1.02),  # the launcher's overhead without its core binding
    ("multigpu-debug", "multigpu", None),  # what --debug's checks cost
    ("accelerate", "torchrun", None),
)


def paired_ratios(runs: dict[str, list[dict[str, float]]], name: str, base: str, key: str) -> list[float]:
    """``name``'s figure / ``base``'s in each repeat (runs back to back, so slow phases mostly cancel)."""
    return [a[key] / b[key] for a, b in zip(runs[name], runs[base])]


def median_interval(values: list[float], level: float = 0.9, draws: int = 4000) -> tuple[float, float]:
    """Bootstrap ``level`` interval of the median of ``values`` (seeded: the same runs print the same)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    tail = int(draws * (1 - level) / 2)
    return medians[tail], medians[draws - 1 - tail]


def verdict(ratio: float, interval: tuple[float, float], target: float | None) -> str:
    if target is None:
        return "-"
    low, high = interval
    if high <= target:
        return "met"
    if low > target:
        return "NOT met"
    return "met at the median; noise spans the target" if ratio <= target else "not resolved: noise spans the target"


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    med = {name: statistics.median(r["ms_per_step"] for r in rs) for name, rs in runs.items()}
    per_launcher = Table(
        title=f"DDP on {NPROC} CPU processes (gloo): global batch {args.global_batch}, "
        f"{args.steps} steps per run, {args.repeats} repeats (medians over repeats)"
    )
    for col in ("launcher", "ms/step median", "mean", "p10", "spread of medians", "launch wall s"):
        per_launcher.add_column(col, justify="left" if col == "launcher" else "right")
    for name, rs in runs.items():
        steps = [r["ms_per_step"] for r in rs]
        per_launcher.add_row(
            name,
            f"{med[name]:.2f}",
            f"{statistics.median(r['mean'] for r in rs):.2f}",
            f"{statistics.median(r['p10'] for r in rs):.2f}",
            f"{min(steps):.2f}..{max(steps):.2f}",
            f"{statistics.median(r['wall_s'] for r in rs):.1f}",
        )
    console.print(per_launcher)

    ratios = Table(title="Ratios: median over repeats of the per-repeat ratio, with a bootstrap 90% interval")
    for col in ("ratio", "of", "value", "90% interval", "target", "verdict"):
        ratios.add_column(col, justify="left" if col in ("ratio", "of", "verdict") else "right")
    for name, base, target in TARGETS:
        if name not in runs or base not in runs:
            continue
        for key, label in STATISTICS.items():
            values = paired_ratios(runs, name, base, key)
            ratio, interval = statistics.median(values), median_interval(values)
            ratios.add_row(
                f"{name} / {base}",
                label,
                f"{ratio:.3f}",
                f"{interval[0]:.3f}..{interval[1]:.3f}",
                f"<= {target:.2f}" if target else "-",
                verdict(ratio, interval, target),
            )
    console.print(ratios)
    overhead = api_overhead_us()
    console.print(
        f"Session API overhead per step, measured in one process (tiny model, min of 7 x 3000 steps): "
        f"{overhead['session_us'] - overhead['plain_us']:+.1f} us ({overhead['plain_us']:.1f} us plain loop, "
        f"{overhead['session_us']:.1f} us Session loop)"
    )
    ledger = ledger_overhead_us()
    console.print(
        f"Collective ledger per collective (always on): {ledger['on']:.2f} us under a launch "
        f"({ledger['off']:.2f} us without its file); a ddp Session step enters 2 collectives"
    )
    _figure(med, runs, Path(args.out_dir) / "launch_overhead.png")
    console.print(
        f"figure: {Path(args.out_dir) / 'launch_overhead.png'}; every repeat: {Path(args.out_dir) / 'runs.json'}"
    )


def _figure(med: dict[str, float], runs: dict[str, list[dict[str, float]]], path: Path) -> None:
    """Left: ms/step per launcher (bars: median, dots: repeats). Right: each repeat's ratio to torchrun."""
    from multigpu.report.figures import pyplot, save_figure

    colors = {
        "torchrun": "#888888",
        "multigpu": "#2a7ab9",
        "multigpu-unbound": "#8fb8de",
        "multigpu-debug": "#b05ca8",
        "accelerate": "#e39b2d",
    }
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    names = list(med)
    left.bar(names, [med[n] for n in names], color=[colors[n] for n in names])
    for i, name in enumerate(names):
        left.scatter([i] * len(runs[name]), [r["ms_per_step"] for r in runs[name]], color="black", s=10, zorder=3)
    left.set_ylabel("ms per step (median; dots: repeats)")
    left.set_title(f"DDP step time, {NPROC} CPU processes")
    others = [n for n in names if n != "torchrun"] if "torchrun" in runs else []
    for i, name in enumerate(others):
        ratios = paired_ratios(runs, name, "torchrun", "ms_per_step")
        right.scatter([i] * len(ratios), ratios, color=colors[name], s=14, zorder=3)
        right.plot([i - 0.25, i + 0.25], [statistics.median(ratios)] * 2, color="black", linewidth=2)
    right.axhline(1.0, color="#888888", linewidth=1)
    right.axhline(1.02, color="#c44e52", linestyle="--", linewidth=1, label="target: multigpu <= 1.02")
    right.set_xticks(range(len(others)), others)
    right.set_xlim(-0.6, len(others) - 0.4)
    right.set_ylabel("median step / torchrun's, same repeat")
    right.set_title("Per-repeat ratio (bar: median)")
    right.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per run (fewer: noisier medians)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--global-batch", type=int, default=256, help="samples per step over both processes")
    parser.add_argument("--hidden", type=int, default=512, help="MLP width")
    parser.add_argument("--repeats", type=int, default=9, help="runs per launcher (median reported)")
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
        except ImportError as exc:
            raise SystemExit(
                "Accelerate is not installed: pip install -e '.[bench]' (or pass --launchers torchrun multigpu)"
            ) from exc
    report(measure(args), args)


if __name__ == "__main__":
    main()
