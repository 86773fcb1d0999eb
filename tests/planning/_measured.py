"""Predicted vs measured step times on this CPU: DataParallel "cpu:2" and 2-process gloo DDP.

The machine is shared and its load changes by the second, so calibration and measurement
alternate in pairs: each iteration measures the machine (one replica alone, the replicas at once, an all-reduce)
and, right after, one real step; the model (:mod:`multigpu.planning.costs`) predicts that step from
that calibration. The check is the median over pairs of predicted / measured.

Run by hand:  .venv/bin/python -m tests.planning._measured
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import multigpu
from multigpu.planning.costs import predict_step
from multigpu.planning.hardware import measured_link
from multigpu.planning.measure import (
    ReplicaProbe,
    allreduce_busbw,
    fastest_s,
    measure_workload,
    memory_bandwidth,
    thread_handoff_s,
)
from multigpu.planning.platform import Platform
from multigpu.planning.workload import Workload

BATCH = 512
HALF = BATCH // 2
REPEATS = 5
ITERATIONS = 25  # paired measurements per configuration


def build_mlp() -> nn.Module:
    """~1.6M parameters: compute dominates thread handoffs, and a step takes tens of ms."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def batch(n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 512, generator=gen), torch.randint(0, 10, (n,), generator=gen)


_TARGETS = batch()[1]


def loss_fn(output: torch.Tensor) -> torch.Tensor:
    """The training loss on the first ``len(output)`` targets (the probes run the first chunk)."""
    return nn.functional.cross_entropy(output, _TARGETS[: output.shape[0]])


def _best(fn: Callable[[], object], repeats: int = REPEATS, warmup: bool = True) -> float:
    """Fastest of ``repeats`` calls, as the library's measurements take (load only adds time)."""
    return fastest_s(fn, repeats, warmup=int(warmup))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _cpu_platform(contention: float, busbw: float | None = None) -> Platform:
    mem_bw = memory_bandwidth()
    return Platform(
        name="cpu",
        memory_bytes=None,
        memory_bandwidth=mem_bw,
        link=measured_link(busbw if busbw is not None else mem_bw),
        peer_copies=False,
        overlap=0.0,
        cores=os.cpu_count() or 1,
        contention=max(1.0, contention),
        thread_overhead_s=thread_handoff_s(),
    )


def _predict(strategy: str, base: Workload, solo: float, together: float, busbw: float | None, plat: Platform) -> float:
    """The model's step for one paired measurement: per-sample compute from the lone replica,
    contention from the replicas running at once."""
    w = replace(base, compute_s_per_sample=solo / HALF)
    p = replace(plat, contention=max(1.0, together / solo), link=measured_link(busbw) if busbw else plat.link)
    return predict_step(strategy, w, p, devices=2, per_device_batch=HALF).total_s


def dataparallel_check(iterations: int) -> list[tuple[float, float]]:
    """(predicted, measured) step seconds of multigpu.DataParallel on "cpu:2", one pair per iteration."""
    model = build_mlp()
    step = _train_step(multigpu.DataParallel(model, devices="cpu:2"), _sgd(model), *batch())
    x, probe = batch()[0], build_mlp()
    base = measure_workload(probe, x[:HALF], loss_fn=loss_fn, repeats=REPEATS, optimizer="sgd-momentum")
    plat = _cpu_platform(1.0)
    _best(step)  # warm the engine's threads
    pairs = []
    with ReplicaProbe(probe, x[:HALF], loss_fn=loss_fn) as replicas:
        replicas.times(repeats=1)  # warm the probe's threads
        for _ in range(iterations):  # calibration and the real step back to back: the same machine load
            solo, together = replicas.times(repeats=1, warmup=0)
            predicted = _predict("dataparallel", base, solo, together, None, plat)
            pairs.append((predicted, _best(step, repeats=1, warmup=False)))
    return pairs


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
        _best(ddp_step)  # build DDP's buckets and warm gloo
        for _ in range(rounds):
            dist.barrier()
            solo = (
                _best(_compute(plain, x, y), repeats=1, warmup=False) if rank == 0 else 0.0
            )  # rank 1 idles: one device alone
            dist.barrier()
            # Both ranks compute at once (the cores are shared); like a DDP step, the slower one sets the pace.
            compute = _compute(plain, x, y)
            both = _best(lambda: (compute(), dist.barrier()), repeats=1, warmup=False)  # noqa: B023 (called at once, inside this iteration)
            opt_s = _best(plain_opt.step, repeats=1, warmup=False)
            busbw = allreduce_busbw(grad_bytes, repeats=1)
            dist.barrier()
            rows.append(f"{solo} {both} {opt_s} {busbw} {_best(ddp_step, repeats=1, warmup=False)}\n")
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


def ddp_check(port: int, out_dir: str, iterations: int, timeout_s: float = 90.0) -> list[tuple[float, float]]:
    """(predicted, measured) step seconds of 2-process gloo DDP, one pair per iteration."""
    _run_workers(port, out_dir, iterations, timeout_s)
    per_rank = [
        [list(map(float, line.split())) for line in Path(out_dir, f"rounds{r}.txt").read_text().splitlines()]
        for r in range(2)
    ]
    params = sum(p.numel() for p in build_mlp().parameters())
    plat = _cpu_platform(1.0)
    pairs = []
    for r0, r1 in zip(*per_rank):
        # The slower rank sets the pace of a DDP step; the all-reduce runs at the slower end's rate.
        base = Workload(
            name="mlp", params=params, compute_s_per_sample=1.0, optimizer="sgd-momentum", optimizer_s=max(r0[2], r1[2])
        )
        predicted = _predict("ddp", base, r0[0], max(r0[1], r1[1]), min(r0[3], r1[3]), plat)
        pairs.append((predicted, max(r0[4], r1[4])))
    return pairs


def median_ratio(pairs: list[tuple[float, float]]) -> float:
    """Median over paired measurements of predicted / measured."""
    return statistics.median(p / m for p, m in pairs)


if __name__ == "__main__":
    import tempfile

    from tests.conftest import free_port

    torch.set_num_threads(1)
    for name, pairs in (("dataparallel cpu:2", dataparallel_check(ITERATIONS)),):
        print(f"{name:20s} median predicted/measured {median_ratio(pairs):.2f} over {len(pairs)} pairs")
    with tempfile.TemporaryDirectory() as tmp:
        pairs = ddp_check(free_port(), tmp, ITERATIONS)
    print(f"{'ddp gloo x2':20s} median predicted/measured {median_ratio(pairs):.2f} over {len(pairs)} pairs")
