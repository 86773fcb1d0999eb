"""Peak memory per process and step time of fsdp against ddp, 2 gloo processes, in one run.

    python benchmarks/fsdp_memory.py                  # 3 alternating rounds: table + PNG
    python benchmarks/fsdp_memory.py --rounds 5 --blocks 8 --width 1024

The model is a stack of residual MLP blocks (``--blocks`` x 2 Linear(width, width), default
16 x 2 x 1024^2: 33.6M parameters): its parameters, gradients and AdamW's two moments dominate
the memory, as in the case fsdp is for; the batch is small, so activations do not. Both strategies
train it through the Session (``multigpu launch --strategy ddp|fsdp --nproc-per-node 2``,
``FSDPOptions(wrap=[Block])``), same seed, same data. Goal: fsdp's peak per process <= 0.6x
ddp's at 2 processes (ideal: 0.5x plus the one or two blocks gathered whole at a time). The
step-time ratio is reported as measured.

How memory is measured: the peak resident set size each process reaches after it joined the
process group (the kernel's VmHWM, reset through /proc/self/clear_refs just before the model is
built, after a tiny warm-up step has loaded kernels and thread pools), minus its resident size at
that moment: what training the model added, as the OS charges it.
Each strategy runs under three C-allocator settings:

- ``as launched``: what ``multigpu launch`` gives each strategy. fsdp's workers on the CPU start
  with glibc's malloc set to return large freed buffers at once, on huge pages
  (``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072:glibc.malloc.hugetlb=1``, from
  ``CpuDevice.sharded_process_env``); ddp's with glibc as it comes. The goal is checked here.
- ``glibc default`` (both): the C allocator as it comes (a malloc setting of the user's own,
  the default value, so that the launcher adds nothing). After the first large buffer is freed,
  glibc raises its mmap threshold and serves later buffers from its heap, which it rarely gives
  back: fsdp, which allocates and frees every block's gathered parameters and gradients at each
  step, keeps far more resident than it holds live.
- ``fsdp's setting`` (both): ddp under the same setting, so that the ratio compares the strategies
  under one allocator.

The project's allocation tracker (``multigpu.track_memory``) is not used: FSDP2 frees gathered
parameters by resizing their storage to zero bytes, which no dispatch mode sees, so the tracker
counts every block's gathered copy as still alive. The table also shows the bytes of parameters
and optimizer state each process holds after a step (fsdp: its shards), computed from the tensors.

Rounds alternate the order of the runs; a ratio is the median over rounds of the per-round
ratio. This file is also the worker (``--worker``). Linux only (/proc).
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

STRATEGIES = ("ddp", "fsdp")
GOAL = 0.6


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.relu(self.inner(x)))


# -- the worker: one process of a launched run -------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state this process holds (its shards under fsdp)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return getattr(t, "_local_tensor", t)

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _warm_up(session: Any) -> None:
    """A tiny step and a collective: kernels, thread pools and gloo buffers load before the baseline."""
    tiny = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(tiny.parameters())
    F.mse_loss(tiny(torch.randn(4, 8)), torch.zeros(4, 8)).backward()
    optimizer.step()
    session.reduce(1.0)


def run_worker(args: argparse.Namespace) -> None:
    from multigpu.session import FSDPOptions, Session

    with Session(strategy="auto", fsdp=FSDPOptions(wrap=[Block])) as session:
        _warm_up(session)
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from here
        baseline_kib = _status_kib("VmRSS")
        model = session.setup_model(nn.Sequential(*[Block(args.width) for _ in range(args.blocks)]))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(session.global_rank)
        x = torch.randn(args.batch // session.world_size, args.width, generator=gen)
        ends = []
        for _ in range(args.warmup + args.steps + 1):
            with session.micro_step(model):
                session.backward(F.mse_loss(model(x), x))
            session.step(optimizer)
            ends.append(time.perf_counter())
        session.barrier()
        steps = [1000.0 * (b - a) for a, b in zip(ends[args.warmup :], ends[args.warmup + 1 :])]
        result = {
            "strategy": session.strategy_name,
            "rank": session.global_rank,
            "peak_added": (_status_kib("VmHWM") - baseline_kib) * 1024,
            "state": _state_bytes(model, optimizer),
            "ms_per_step": statistics.median(steps),
            "parameters": sum(p.numel() for p in model.parameters()),
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        }
        Path(f"{args.result}.rank{session.global_rank}").write_text(json.dumps(result))


# -- the driver ----------------------------------------------------------------------------------------


def _allocators() -> dict[str, dict[str, str]]:
    from multigpu.devices import get_device_type

    fsdp_setting = get_device_type("cpu").sharded_process_env({})
    return {
        "as launched": {},
        "glibc default": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},
        "fsdp's setting": fsdp_setting,
    }


ALLOCATORS = _allocators()
RUNS = [(strategy, allocator) for allocator in ALLOCATORS for strategy in STRATEGIES]
Runs = dict[str, list[list[dict[str, Any]]]]  # "strategy|allocator" -> rounds -> ranks


def run_once(strategy: str, allocator: str, args: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    result = out_dir / f"{strategy}.json"
    worker = [str(Path(__file__).resolve()), "--worker", "--result", str(result)]
    worker += ["--blocks", str(args.blocks), "--width", str(args.width), "--batch", str(args.batch)]
    worker += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command = [sys.executable, "-m", "multigpu", "launch", "--strategy", strategy, "--nproc-per-node", "2", *worker]
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env = {**inherited, **ALLOCATORS[allocator]}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{strategy} ({allocator}) failed:\n{done.stderr[-3000:]}")
    ranks = [json.loads(Path(f"{result}.rank{r}").read_text()) for r in (0, 1)]
    wanted = ALLOCATORS[allocator].get("GLIBC_TUNABLES")
    if allocator == "as launched" and strategy == "fsdp":
        wanted = ALLOCATORS["fsdp's setting"]["GLIBC_TUNABLES"]
    if any(r["glibc_tunables"] != wanted for r in ranks):
        raise SystemExit(
            f"{strategy} ({allocator}) ran with GLIBC_TUNABLES={ranks[0]['glibc_tunables']!r}, not {wanted!r}"
        )
    return ranks


def measure(args: argparse.Namespace) -> Runs:
    from rich.progress import Progress

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: Runs = {f"{s}|{a}": [] for s, a in RUNS}
    with Progress() as progress:
        task = progress.add_task("ddp / fsdp runs", total=args.rounds * len(RUNS))
        for index in range(args.rounds):
            for strategy, allocator in RUNS if index % 2 == 0 else RUNS[::-1]:
                runs[f"{strategy}|{allocator}"].append(run_once(strategy, allocator, args, out_dir))
                progress.advance(task)
    (out_dir / "runs.json").write_text(json.dumps(runs, indent=1))
    return runs


def _peak(ranks: list[dict[str, Any]]) -> float:
    return float(max(r["peak_added"] for r in ranks))


def _ms(ranks: list[dict[str, Any]]) -> float:
    return statistics.fmean(r["ms_per_step"] for r in ranks)


def summarize(runs: Runs) -> dict[str, dict[str, float]]:
    """Per run kind, medians over rounds (largest rank's peak and state, mean ms/step); fsdp/ddp ratios per allocator."""
    out = {
        key: {
            "peak": statistics.median(_peak(ranks) for ranks in rounds),
            "state": statistics.median(max(r["state"] for r in ranks) for ranks in rounds),
            "ms": statistics.median(_ms(ranks) for ranks in rounds),
        }
        for key, rounds in runs.items()
    }
    for allocator in ALLOCATORS:
        pairs = list(zip(runs[f"ddp|{allocator}"], runs[f"fsdp|{allocator}"], strict=True))
        out[f"ratio|{allocator}"] = {
            "peak": statistics.median(_peak(f) / _peak(d) for d, f in pairs),
            "ms": statistics.median(_ms(f) / _ms(d) for d, f in pairs),
        }
    return out


def report(runs: Runs, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    summary = summarize(runs)
    params = runs[f"ddp|{next(iter(ALLOCATORS))}"][0][0]["parameters"]
    mib = 2**20
    table = Table(title=f"{params / 1e6:.1f}M parameters, AdamW, 2 gloo processes, median of {args.rounds} rounds")
    for column in ("allocator", "strategy", "peak added / process", "params + optimizer state", "ms/step"):
        table.add_column(column, justify="right")
    for strategy, allocator in RUNS:
        s = summary[f"{strategy}|{allocator}"]
        row = [f"{s['peak'] / mib:.0f} MiB", f"{s['state'] / mib:.0f} MiB", f"{s['ms']:.1f}"]
        table.add_row(allocator, strategy, *row)
    console = Console()
    console.print(table)
    for allocator in ALLOCATORS:
        ratio = summary[f"ratio|{allocator}"]
        verdict = "meets" if ratio["peak"] <= GOAL else "misses"
        console.print(
            f"{allocator}: fsdp / ddp peak per process {ratio['peak']:.2f}x ({verdict} the goal <= {GOAL}x), "
            f"step time {ratio['ms']:.2f}x"
        )
    path = Path(args.out_dir) / "fsdp_memory.png"
    _figure(summary, path)
    console.print(f"figure: {path}; every run: {Path(args.out_dir) / 'runs.json'}")


def _figure(summary: dict[str, dict[str, float]], path: Path) -> None:
    from multigpu.report.figures import pyplot, save_figure

    plt = pyplot()
    fig, (mem, time_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    mib = 2**20
    xs = list(range(len(STRATEGIES)))
    width = 0.8 / (len(ALLOCATORS) + 1)
    for i, allocator in enumerate(ALLOCATORS):
        offset = (i - len(ALLOCATORS) / 2) * width
        peaks = [summary[f"{s}|{allocator}"]["peak"] / mib for s in STRATEGIES]
        mem.bar([x + offset for x in xs], peaks, width, label=f"peak, {allocator}")
        times = [summary[f"{s}|{allocator}"]["ms"] for s in STRATEGIES]
        time_ax.bar([x + offset for x in xs], times, width, label=allocator)
    states = [summary[f"{s}|{next(iter(ALLOCATORS))}"]["state"] / mib for s in STRATEGIES]
    offset = len(ALLOCATORS) / 2 * width
    mem.bar([x + offset for x in xs], states, width, label="params + optimizer state", color="grey")
    for ax, label in ((mem, "MiB added per process"), (time_ax, "ms / step")):
        ax.set_xticks(xs, STRATEGIES)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    ratios = ", ".join(f"{a}: {summary[f'ratio|{a}']['peak']:.2f}x" for a in ALLOCATORS)
    fig.suptitle(f"fsdp / ddp peak memory per process ({ratios})", fontsize=9)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the six runs, order alternating (default 3)")
    parser.add_argument("--blocks", type=int, default=16, help="residual blocks of 2 Linear layers (default 16)")
    parser.add_argument("--width", type=int, default=1024, help="layer width (default 1024)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    parser.add_argument("--out-dir", default="out/bench", help="where the PNG and per-run results go")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("needs Linux's /proc/self/clear_refs to reset the peak resident size")
    report(measure(args), args)


if __name__ == "__main__":
    main()
