"""Training-step time: one device (1 and 2 intra-op threads) vs DataParallel on "cpu:2" vs
torch DDP over gloo with 2 processes, for a ~2M-parameter MLP at global batch 512.

    python benchmarks/step_time.py [--steps 30] [--rounds 3]

Every configuration runs the same step (forward, MSE loss, backward, SGD) on the same global
batch; rounds are interleaved so that noise on the shared machine hits all of them alike.
Target (issue 2): DataParallel on cpu:2 at least as fast as 2-process DDP over gloo.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table
from torch import nn

import multigpu

GLOBAL_BATCH = 512


def build_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))


def time_steps(model: nn.Module, params: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    """Median ms per training step after two warm-up steps."""
    optimizer = torch.optim.SGD(params.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 2):
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if i >= 2:
            times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def single(threads: int, steps: int) -> float:
    torch.set_num_threads(threads)
    net = build_mlp()
    x, y = torch.randn(GLOBAL_BATCH, 512), torch.randn(GLOBAL_BATCH, 512)
    return time_steps(net, net, x, y, steps)


def data_parallel(steps: int) -> float:
    torch.set_num_threads(2)
    net = build_mlp()
    x, y = torch.randn(GLOBAL_BATCH, 512), torch.randn(GLOBAL_BATCH, 512)
    return time_steps(multigpu.DataParallel(net, devices="cpu:2"), net, x, y, steps)


def _ddp_worker(rank: int, port: int, steps: int, result: mp.Queue[float]) -> None:
    torch.set_num_threads(1)  # what torchrun gives each of 2 processes on 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    net = build_mlp()
    model = nn.parallel.DistributedDataParallel(net)
    x, y = torch.randn(GLOBAL_BATCH // 2, 512), torch.randn(GLOBAL_BATCH // 2, 512)
    ms = time_steps(model, net, x, y, steps)
    if rank == 0:
        result.put(ms)
    del model  # release DDP's reducer before the group goes (an abort at exit otherwise: pytorch#190489)
    gc.collect()
    dist.destroy_process_group()


def ddp(steps: int) -> float:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    result: mp.Queue[float] = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(rank, port, steps, result)) for rank in range(2)]
    for p in procs:
        p.start()
    ms = result.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    configs = {
        "one device, 1 thread": lambda: single(1, args.steps),
        "one device, 2 threads": lambda: single(2, args.steps),
        "multigpu.DataParallel cpu:2": lambda: data_parallel(args.steps),
        "torch DDP gloo, 2 processes": lambda: ddp(args.steps),
    }
    console = Console()
    samples: dict[str, list[float]] = {name: [] for name in configs}
    with console.status("measuring") as status:
        for r in range(args.rounds):
            for name, fn in configs.items():
                status.update(f"round {r + 1}/{args.rounds}: {name}")
                samples[name].append(fn())
    ms = {name: statistics.median(v) for name, v in samples.items()}
    base = ms["one device, 1 thread"]
    table = Table(
        title=f"Training step, ~2.1M-parameter MLP, global batch {GLOBAL_BATCH} (median of {args.rounds} rounds)"
    )
    for col in ("configuration", "ms/step", "vs 1 thread", "vs DDP x2"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for name, value in ms.items():
        table.add_row(name, f"{value:.1f}", f"{value / base:.2f}", f"{value / ms['torch DDP gloo, 2 processes']:.2f}")
    console.print(table)
    ratio = ms["multigpu.DataParallel cpu:2"] / ms["torch DDP gloo, 2 processes"]
    verdict = "meets" if ratio <= 1.0 else "misses"
    console.print(f"DataParallel cpu:2 / DDP x2 = {ratio:.2f} ({verdict} the target <= 1.00)")


if __name__ == "__main__":
    main()
