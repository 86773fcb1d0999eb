"""Predicted vs measured step times on this CPU: DataParallel "cpu:2" and 2-process gloo DDP.

The machine is shared and its load changes by the second, so calibration and measurement
alternate in rounds: each round measures the machine (one-device compute, replica contention,
memory and all-reduce bandwidth), predicts the step with :mod:`multigpu.planning.costs`, then
times the real step. Each timing is the best of a few repeats; the report is the median over
rounds of predicted / measured.

Run by hand:  .venv/bin/python -m tests.planning._measured
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import multigpu
from multigpu.planning.costs import predict_step
from multigpu.planning.hardware import measured_link
from multigpu.planning.measure import allreduce_busbw, measure_cpu_platform, measure_workload, memory_bandwidth
from multigpu.planning.platform import Platform
from multigpu.planning.workload import Workload

BATCH = 512
HALF = BATCH // 2
REPEATS = 5


def build_mlp() -> nn.Module:
    """~1.6M parameters: compute dominates thread handoffs, and a step takes tens of ms."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def batch(n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 512, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def loss_fn(output: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, batch(output.shape[0])[1])


def _best(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """Fastest of ``repeats`` calls, as the library's measurements take (load only adds time)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def dataparallel_rounds(rounds: int) -> list[tuple[float, float]]:
    """(predicted, measured) step seconds of multigpu.DataParallel on "cpu:2", one pair per round."""
    model = build_mlp()
    step = _train_step(multigpu.DataParallel(model, devices="cpu:2"), _sgd(model), *batch())
    x = batch()[0]
    out = []
    for _ in range(rounds):
        w = measure_workload(build_mlp(), x, loss_fn=loss_fn, repeats=REPEATS, optimizer="sgd-momentum")
        plat = measure_cpu_platform(build_mlp(), x[:HALF], loss_fn=loss_fn, rounds=1)
        predicted = predict_step("dataparallel", w, plat, devices=2, per_device_batch=HALF).total_s
        out.append((predicted, _best(step)))
    return out


def _compute(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()

    return run


def _ddp_worker(rank: int, port: int, out_dir: str, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        x, y = (t[rank * HALF : (rank + 1) * HALF] for t in batch())
        plain, model = build_mlp(), build_mlp()
        plain_opt = _sgd(plain)
        ddp_step = _train_step(nn.parallel.DistributedDataParallel(model), _sgd(model), x, y)
        grad_bytes = sum(p.numel() for p in model.parameters()) * 4
        rows = []
        for _ in range(rounds):
            dist.barrier()
            solo = _best(_compute(plain, x, y)) if rank == 0 else 0.0  # rank 1 idles: one device alone
            dist.barrier()
            # Both ranks compute at once (the cores are shared); like a DDP step, the slower one sets the pace.
            compute = _compute(plain, x, y)
            both = _best(lambda: (compute(), dist.barrier()))
            opt_s = _best(plain_opt.step)
            busbw = allreduce_busbw(grad_bytes, repeats=REPEATS)
            dist.barrier()
            rows.append(f"{solo} {both} {opt_s} {busbw} {_best(ddp_step)}\n")
        with open(os.path.join(out_dir, f"rounds{rank}.txt"), "w") as f:
            f.writelines(rows)
    finally:
        dist.destroy_process_group()


def _run_workers(port: int, out_dir: str, rounds: int, timeout_s: float) -> None:
    ctx = mp.start_processes(_ddp_worker, args=(port, out_dir, rounds), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"DDP workers did not finish within {timeout_s} s")
    finally:  # no worker outlives the call
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def ddp_rounds(port: int, out_dir: str, rounds: int, timeout_s: float = 90.0) -> list[tuple[float, float]]:
    """(predicted, measured) step seconds of 2-process gloo DDP, one pair per round."""
    _run_workers(port, out_dir, rounds, timeout_s)
    params = sum(p.numel() for p in build_mlp().parameters())
    mem_bw = memory_bandwidth()
    out = []
    per_rank = [open(os.path.join(out_dir, f"rounds{rank}.txt")).read().split("\n")[:-1] for rank in range(2)]
    for line0, line1 in zip(*per_rank):
        r0, r1 = [float(v) for v in line0.split()], [float(v) for v in line1.split()]
        # The slower rank sets the pace of a DDP step; the all-reduce runs at the slower end's rate.
        solo, both, opt_s = r0[0], max(r0[1], r1[1]), max(r0[2], r1[2])
        busbw, measured = min(r0[3], r1[3]), max(r0[4], r1[4])
        w = Workload(
            name="mlp", params=params, compute_s_per_sample=solo / HALF, optimizer="sgd-momentum", optimizer_s=opt_s
        )
        plat = Platform(
            name="cpu",
            memory_bytes=None,
            memory_bandwidth=mem_bw,
            link=measured_link(busbw),
            peer_copies=False,
            overlap=0.0,
            cores=os.cpu_count() or 1,
            contention=max(1.0, both / solo),
        )
        out.append((predict_step("ddp", w, plat, devices=2, per_device_batch=HALF).total_s, measured))
    return out


def median_ratio(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(p / m for p, m in pairs)


if __name__ == "__main__":
    import tempfile

    from tests.conftest import free_port

    torch.set_num_threads(1)
    for name, pairs in (("dataparallel cpu:2", dataparallel_rounds(7)),):
        print(name, [(round(p * 1e3, 1), round(m * 1e3, 1)) for p, m in pairs], f"median ratio {median_ratio(pairs):.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        pairs = ddp_rounds(free_port(), tmp, 7)
    print("ddp gloo x2", [(round(p * 1e3, 1), round(m * 1e3, 1)) for p, m in pairs], f"median ratio {median_ratio(pairs):.2f}")
