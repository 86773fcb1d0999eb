"""Planner accuracy on this CPU: predicted vs measured step time, five models x three strategies, + fsdp.

    python benchmarks/planner_accuracy.py [--pairs 11] [--models mlp,cnn-bn,...] [--fsdp-models mlp] [--figure PNG]
    python benchmarks/planner_accuracy.py --via-advise [--budget 60] [--models mlp,cnn-bn]

Models: an MLP, a CNN with BatchNorm, a small transformer with an Embedding, a grouped-conv net
and an LSTM. Strategies: ``single`` (one process, one thread), ``dp`` (``multigpu.DataParallel``
on ``"cpu:2"``) and ``ddp`` (torch DDP over gloo, two processes of one thread each); ``fsdp``
(the Session's FSDP2 sharding, ``multigpu.strategies.fsdp.apply_fsdp`` with the default
``FSDPOptions``, two gloo processes) for the models in ``--fsdp-models`` (default: the MLP).

The machine is shared and its load changes by the second, so calibration and measurement come in
pairs: each pair measures what the model needs (the workload, one replica alone and two at once,
an all-reduce), predicts the step with :func:`multigpu.planning.predict_step`, and right after
times one real training step (zero_grad, forward, loss, backward, optimizer step). The figure of
merit is the median over pairs of predicted / measured; the goal is 0.75-1.25 for every row.
Host costs (:mod:`multigpu.planning.calibrate`) are measured once per run. Writes a table here and
``benchmarks/figures/planner-accuracy-cpu2.png``. Not niced: it is a timing benchmark; rerun when
``uptime`` shows other load.

``--via-advise`` checks the same models the way a user does: ``multigpu advise --measure`` on each
model's factory (``benchmarks.planner_accuracy:mlp`` ...), which predicts from one calibration and
then times every strategy in its own processes, one after another, within ``--budget`` seconds; the
table is its JSON's predicted and measured step times. The pairs above are the finer figure (the
same load for prediction and step); this one is the user's path, end to end.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table
from torch import nn

import multigpu
from multigpu.planning import predict_step
from multigpu.planning.calibrate import (
    ReplicaProbe,
    allreduce_busbw,
    device_contention,
    gather_busbw,
    measure_host_costs,
    memory_bandwidth,
    thread_handoff_s,
)
from multigpu.planning.costs import host_step_s
from multigpu.planning.counting import count_fsdp_groups, fastest_s, measure_workload
from multigpu.planning.hardware import HostCosts, Platform, measured_link
from multigpu.planning.workload import FsdpLayout
from multigpu.strategies.fsdp import FSDPOptions, apply_fsdp, select_blocks

FIGURE = Path(__file__).parent / "figures" / "planner-accuracy-cpu2.png"
STRATEGIES = ("single", "dp", "ddp", "fsdp")
GOAL = (0.75, 1.25)


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)).mean(dim=1))


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def _conv_bn(cin: int, cout: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, groups=groups, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if name == "cnn-bn":
        layers = [*_conv_bn(3, 32), *_conv_bn(32, 64, 2), *_conv_bn(64, 64, 2)]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    if name == "grouped-conv":
        layers = [*_conv_bn(3, 64), *_conv_bn(64, 64, 2, groups=8), *_conv_bn(64, 64, 1, groups=64)]
        layers += [nn.Conv2d(64, 128, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(), *_conv_bn(128, 128, 2, groups=16)]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
    if name == "transformer":
        return TinyTransformer()
    if name == "lstm":
        return LSTMNet()
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def mlp() -> nn.Module:
    return build("mlp")


def cnn_bn() -> nn.Module:
    return build("cnn-bn")


def transformer() -> nn.Module:
    return build("transformer")


def grouped_conv() -> nn.Module:
    return build("grouped-conv")


def lstm() -> nn.Module:
    return build("lstm")


# per-sample input shape and dtype of each model, for `multigpu advise --input-shape ... --input-dtype ...`
ADVISE_INPUTS = {
    "mlp": ("512", "float32"),
    "cnn-bn": ("3,32,32", "float32"),
    "transformer": ("32", "long"),
    "grouped-conv": ("3,32,32", "float32"),
    "lstm": ("32,64", "float32"),
}


def via_advise(names: list[str], budget_s: float, console: Console) -> None:
    """``multigpu advise --measure --json`` on each model; its predicted and measured steps side by side."""
    import json
    import sys

    table = Table(title=f"multigpu advise --measure (budget {budget_s:.0f} s per model): predicted vs measured")
    for col in ("model", "strategy", "predicted ms", "measured ms", "pred/meas", "goal", "status"):
        table.add_column(col, justify="left" if col in ("model", "strategy", "status") else "right")
    for name in names:
        shape, dtype = ADVISE_INPUTS[name]
        with tempfile.TemporaryDirectory() as out:
            argv = [sys.executable, "-m", "multigpu", "advise", "--measure", "--json", "--no-figure", "--out", out]
            argv += ["--model", f"benchmarks.planner_accuracy:{name.replace('-', '_')}", "--input-shape", shape]
            argv += ["--input-dtype", dtype, "--global-batch", str(MODELS[name][0]), "--optimizer", "sgd-momentum"]
            argv += ["--budget", str(budget_s)]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=budget_s * 3 + 120)
        if done.returncode != 0:
            table.add_row(name, "-", "-", "-", "-", "-", f"advise failed: {done.stdout[-200:]}{done.stderr[-200:]}")
            continue
        for row in json.loads(done.stdout)["measured"]["rows"]:
            pred, meas = row["predicted_step_ms"], row["step_ms"]
            ratio = pred / meas if pred and meas else None
            ok = "-" if ratio is None else "yes" if GOAL[0] <= ratio <= GOAL[1] else "NO"
            table.add_row(
                name,
                f"{row['strategy']} x{row['devices']}",
                f"{pred:.1f}" if pred else "-",
                f"{meas:.1f}" if meas else "-",
                f"{ratio:.2f}" if ratio else "-",
                ok,
                row["status"],
            )
    console.print(table)


# global batch and the inputs of one sample
MODELS: dict[str, tuple[int, Callable[[int, torch.Generator], torch.Tensor]]] = {
    "mlp": (512, lambda n, g: torch.randn(n, 512, generator=g)),
    "cnn-bn": (64, lambda n, g: torch.randn(n, 3, 32, 32, generator=g)),
    "transformer": (64, lambda n, g: torch.randint(0, 1000, (n, 32), generator=g)),
    "grouped-conv": (64, lambda n, g: torch.randn(n, 3, 32, 32, generator=g)),
    "lstm": (64, lambda n, g: torch.randn(n, 32, 64, generator=g)),
}


def batch(name: str, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    size, make = MODELS[name]
    gen = torch.Generator().manual_seed(1)
    n = n or size
    return make(n, gen), torch.randint(0, 10, (n,), generator=gen)


def _loss(targets: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda out: nn.functional.cross_entropy(out, targets[: out.shape[0]])


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _platform(host: HostCosts, contention: float = 1.0, busbw: float | None = None) -> Platform:
    mem_bw = memory_bandwidth()
    return Platform(
        name="cpu",
        memory_bytes=None,
        memory_bandwidth=mem_bw,
        link=measured_link(busbw or mem_bw / 2),
        peer_copies=False,
        overlap=0.0,
        cores=os.cpu_count() or 1,
        contention=max(1.0, contention),
        thread_overhead_s=thread_handoff_s(),
        host=host,
        synchronous=True,
    )


def single_pairs(name: str, host: HostCosts, pairs: int) -> list[tuple[float, float]]:
    """(predicted, measured) seconds of one step on one thread, from a fresh measurement each pair."""
    x, y = batch(name)
    model = build(name)
    step = _train_step(model, _sgd(model), x, y)
    plat, out = _platform(host), []
    for _ in range(pairs):
        w = measure_workload(build(name), x, loss_fn=_loss(y), repeats=3, host=host)
        out.append((predict_step("single", w, plat, chunks=[len(x)]).total_s, fastest_s(step, 3)))  # as measured
    return out


def dp_pairs(name: str, host: HostCosts, pairs: int) -> list[tuple[float, float]]:
    """(predicted, measured) seconds of multigpu.DataParallel on "cpu:2", one pair per round."""
    x, y = batch(name)
    half = len(x) // 2
    model = build(name)
    step = _train_step(multigpu.DataParallel(model, devices="cpu:2"), _sgd(model), x, y)
    probe_model = build(name)
    base = measure_workload(probe_model, x[:half], loss_fn=_loss(y), repeats=3, host=host)
    plat, out = _platform(host), []
    with ReplicaProbe(probe_model, x[:half], loss_fn=_loss(y)) as replicas:
        for _ in range(pairs):  # calibration and the real step back to back: the same machine load
            solo, together = replicas.times(repeats=1)
            device = max(solo - host_step_s(base.counts, host), 0.1 * solo)
            w = replace(base, compute_s_per_sample=device / half)
            p = replace(plat, contention=device_contention(solo, together, host_step_s(base.counts, host)))
            out.append((predict_step("dp", w, p, chunks=[half, len(x) - half]).total_s, fastest_s(step, 1)))
    return out


def _compute(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()

    return run


def _wrap(strategy: str, model: nn.Module) -> nn.Module:
    if strategy == "fsdp":
        return apply_fsdp(model, torch.device("cpu"), FSDPOptions(), "fp32")
    return nn.parallel.DistributedDataParallel(model)


def _process_worker(rank: int, strategy: str, name: str, port: int, out_dir: str, pairs: int) -> None:
    """One of two gloo processes: per pair, the calibration (compute alone and together, the
    optimizer, the collectives) and right after one real ``strategy`` step."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        full_x, full_y = batch(name)
        half = len(full_x) // 2
        x, y = full_x[rank * half : (rank + 1) * half], full_y[rank * half : (rank + 1) * half]
        plain = build(name)
        wrapped = _wrap(strategy, build(name))
        real_step, plain_opt = _train_step(wrapped, _sgd(wrapped), x, y), _sgd(plain)
        compute = _compute(plain, x, y)
        grad_bytes = sum(p.numel() for p in plain.parameters()) * 4
        group_bytes = [4 * n for n in count_fsdp_groups(plain, select_blocks(plain, FSDPOptions()))]

        def probe() -> float:  # one all-reduce of a small model swings 10x: the best of 3
            if strategy == "ddp":
                return allreduce_busbw(grad_bytes, repeats=3)
            return gather_busbw(group_bytes, repeats=3)  # fsdp's all-gathers and reduce-scatters of one step

        rows = []
        fastest_s(real_step, 1)  # build DDP's buckets / FSDP's buffers and warm gloo
        for _ in range(pairs):
            dist.barrier()
            solo = fastest_s(compute, 1) if rank == 0 else 0.0  # rank 1 idles: one device alone
            dist.barrier()
            both = fastest_s(lambda: (compute(), dist.barrier()), 1)  # both at once, the slower sets the pace
            opt_s = fastest_s(plain_opt.step, 1)
            bandwidth = probe()
            dist.barrier()
            rows.append(f"{solo} {both} {opt_s} {bandwidth} {fastest_s(real_step, 1)}\n")
        Path(out_dir, f"rank{rank}.txt").write_text("".join(rows))
        del wrapped, real_step  # release DDP's reducer / FSDP's state before the group goes
    finally:
        dist.destroy_process_group()


def _run_processes(strategy: str, name: str, pairs: int, timeout_s: float) -> list[list[list[float]]]:
    """Both ranks' rows of :func:`_process_worker`, from two spawned processes (none outlives the call)."""
    with socket.socket() as sock:  # a free port for the rendezvous on loopback
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _process_worker, args=(strategy, name, port, out_dir, pairs), nprocs=2, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{strategy} workers did not finish within {timeout_s} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
        return [
            [list(map(float, line.split())) for line in Path(out_dir, f"rank{r}.txt").read_text().splitlines()]
            for r in range(2)
        ]


def process_pairs(
    strategy: str, name: str, host: HostCosts, pairs: int, timeout_s: float = 300.0
) -> list[tuple[float, float]]:
    """(predicted, measured) seconds of 2-process gloo ``ddp`` or ``fsdp``, one pair per round."""
    ranks = _run_processes(strategy, name, pairs, timeout_s)
    x, y = batch(name)
    half = len(x) // 2
    model = build(name)
    base = measure_workload(model, x[:half], loss_fn=_loss(y), repeats=3, host=host)
    base = replace(base, fsdp=FsdpLayout(groups=count_fsdp_groups(model, select_blocks(model, FSDPOptions()))))
    plat, out = _platform(host), []
    for r0, r1 in zip(*ranks):
        solo, both = r0[0], max(r0[1], r1[1])
        device = max(solo - host_step_s(base.counts, host), 0.1 * solo)
        w = replace(base, compute_s_per_sample=device / half, optimizer_s=max(r0[2], r1[2]))
        # ddp's all-reduce, or fsdp's all-gathers and reduce-scatters, at the bus bandwidth measured for them
        busbw = min(r0[3], r1[3])
        links = {"link": measured_link(busbw)} if strategy == "ddp" else {"gather_busbw": busbw}
        p = replace(plat, contention=device_contention(solo, both, host_step_s(base.counts, host)), **links)
        out.append((predict_step(strategy, w, p, chunks=[half, half]).total_s, max(r0[4], r1[4])))
    return out


def ddp_pairs(name: str, host: HostCosts, pairs: int) -> list[tuple[float, float]]:
    return process_pairs("ddp", name, host, pairs)


def fsdp_pairs(name: str, host: HostCosts, pairs: int) -> list[tuple[float, float]]:
    return process_pairs("fsdp", name, host, pairs)


def figure(results: dict[tuple[str, str], list[tuple[float, float]]], path: Path) -> Path:
    from multigpu.report.figures import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(6.0, 5.0))
    markers = {"single": ("o", "C0"), "dp": ("s", "C1"), "ddp": ("^", "C2"), "fsdp": ("D", "C3")}
    ms = {
        k: (statistics.median(p for p, _ in v) * 1e3, statistics.median(m for _, m in v) * 1e3)
        for k, v in results.items()
    }
    top = max(max(v) for v in ms.values()) * 1.2
    ax.plot([0, top], [0, top], color="grey", lw=1, label="predicted = measured")
    ax.fill_between([0, top], [0, top * GOAL[0]], [0, top * GOAL[1]], color="grey", alpha=0.15, label="within 25%")
    labelled: set[str] = set()
    for (model, strategy), (pred, meas) in ms.items():
        marker, color = markers[strategy]
        ax.scatter(meas, pred, marker=marker, color=color, s=40, label=None if strategy in labelled else strategy)
        labelled.add(strategy)
        ax.annotate(model, (meas, pred), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("measured ms / step (median)")
    ax.set_ylabel("predicted ms / step (median)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title("multigpu advise on this CPU: predicted vs measured", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=11, help="calibration/measurement pairs per row (median)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    parser.add_argument("--fsdp-models", default="mlp", help="models that also get an fsdp row ('' for none)")
    parser.add_argument("--figure", type=Path, default=FIGURE, help=f"where the PNG goes (default {FIGURE.name})")
    parser.add_argument(
        "--via-advise", action="store_true", help="measure through `multigpu advise --measure` instead of pairs"
    )
    parser.add_argument("--budget", type=float, default=60.0, help="--via-advise: seconds of measuring per model")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per replica, as each DDP process has
    console = Console()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    console.print(f"{datetime.datetime.now():%Y-%m-%d %H:%M}, revision {revision}, load {os.getloadavg()[0]:.2f}")
    if args.via_advise:
        via_advise(args.models.split(","), args.budget, console)
        console.print(f"load {os.getloadavg()[0]:.2f} at the end")
        return
    host = measure_host_costs(replicate="multigpu", repeats=15)
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    runners = {"single": single_pairs, "dp": dp_pairs, "ddp": ddp_pairs, "fsdp": fsdp_pairs}
    fsdp_models = set(filter(None, args.fsdp_models.split(",")))
    with console.status("measuring") as status:
        for name in args.models.split(","):
            for strategy in STRATEGIES:
                if strategy == "fsdp" and name not in fsdp_models:
                    continue
                status.update(f"{name}: {strategy}")
                results[name, strategy] = runners[strategy](name, host, args.pairs)
    table = Table(
        title=f"Predicted vs measured step time, medians of {args.pairs} pairs (load {os.getloadavg()[0]:.2f} at the end)"
    )
    for col in ("model", "strategy", "predicted ms", "measured ms", "pred/meas", "goal"):
        table.add_column(col, justify="left" if col in ("model", "strategy") else "right")
    for (name, strategy), pairs in results.items():
        ratio = statistics.median(p / m for p, m in pairs)
        ok = "yes" if GOAL[0] <= ratio <= GOAL[1] else "NO"
        pred, meas = statistics.median(p for p, _ in pairs), statistics.median(m for _, m in pairs)
        table.add_row(name, strategy, f"{pred * 1e3:.1f}", f"{meas * 1e3:.1f}", f"{ratio:.2f}", ok)
    console.print(table)
    console.print(f"figure: {figure(results, args.figure)}")


if __name__ == "__main__":
    main()
