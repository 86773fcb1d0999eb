"""Training-step time of the DataParallel engine against its limits, every ratio of issue 24 in one run.

    python benchmarks/step_time.py [--steps 20] [--rounds 5] [--models mlp,cnn] [--no-ddp] [--trace DIR] [--thread-cpu]

Two models: the ~2.1M-parameter MLP (global batch 512: large GEMMs, where intra-op threading is
good) and the demo's small CNN (``multigpu.demo.model.build_cnn``, 8x8 images, global batch 256:
small convolutions, where it is poor). Every configuration runs the same step (zero_grad, forward,
MSE loss, backward, SGD) on the same global batch. Ratios, each measured side by side:

- ``cpu:2 / 2 threads``: ``multigpu.DataParallel(devices="cpu:2")`` against the bare module on one
  device with 2 intra-op threads (the limit on 2 cores; targets <= 1.05 MLP, <= 0.80 CNN);
- ``1-dev DP / bare``: ``DataParallel`` on one device against the bare module, measured as
  alternating blocks of steps (target <= 1.01), once before each round's ``cpu:2`` run and once right
  after it (``after cpu:2``: the replica thread's OpenMP team has just run);
- ``cpu:2 / DDP``: against torch DDP over gloo, 2 spawned processes of one thread each (target <= 0.85);
- ``raw halves / 2 threads (bound)``: two plain threads of one intra-op thread, each a half batch
  on a model of its own, no engine (no split, replicas or gradient sum), against the bare module:
  the least two replicas on two cores can cost; ``cpu:2 / raw halves (engine)``: what the engine
  adds to it (both paired as the one-device rows are);
- ``bare / bare (noise floor)``: two bare models of the same kind, paired the same way: how far
  from 1.00 a pair strays on this machine at this load (a ratio target finer than it is not resolved).

Rounds are interleaved (every configuration once per round, in the same order) so the load of the
shared machine hits them alike; each figure is the median over rounds of the per-round median.
After the rounds, a per-phase breakdown of one ``cpu:2`` step (the project's step profiler:
scatter, replicate, forward per replica, gather, backward, reduce, optimizer) beside the bare
step's forward, loss, backward and optimizer; ``--trace DIR`` also writes torch.profiler Chrome
traces of both, and ``--thread-cpu`` the CPU time of every thread of the process over ``cpu:2``
steps. ``cat /proc/loadavg`` is printed before and after: the figures are only as quiet as
the machine was.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table
from torch import nn

import multigpu
from multigpu.demo.model import build_cnn

MODELS = {"mlp": 512, "cnn": 256}  # global batch
TARGETS = {
    ("mlp", "cpu:2 / 2 threads"): 1.05,
    ("cnn", "cpu:2 / 2 threads"): 0.80,
    ("mlp", "1-dev DP / bare"): 1.01,
    ("cnn", "1-dev DP / bare"): 1.01,
    ("mlp", "1-dev DP / bare, after cpu:2"): 1.01,
    ("cnn", "1-dev DP / bare, after cpu:2"): 1.01,
    ("mlp", "cpu:2 / DDP gloo x2"): 0.85,
    ("cnn", "cpu:2 / DDP gloo x2"): 0.85,
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))
    return build_cnn()


def batch(name: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":
        return torch.randn(n, 512, generator=gen), torch.randn(n, 512, generator=gen)
    return torch.randn(n, 1, 8, 8, generator=gen), torch.randn(n, 10, generator=gen)


Step = Callable[[], None]


def make_step(model: nn.Module, params: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    optimizer = torch.optim.SGD(params.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    return step


def median_ms(step: Step, steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def paired_ratio(first: Step, second: Step, steps: int, block: int = 3) -> float:
    """Median over alternating blocks of ``first``'s time / ``second``'s (load changes hit both alike)."""
    first(), second()
    ratios = []
    for _ in range(max(1, steps // block)):
        a = median_ms(first, block, warmup=0)
        b = median_ms(second, block, warmup=0)
        ratios.append(a / b)
    return statistics.median(ratios)


class RawHalves:
    """The bound without an engine: two plain threads of one intra-op thread each, each a half batch's
    forward, loss and backward on a model of its own, started and joined by the caller, then one
    optimizer step (the gradients are not summed: what two replicas on two cores cost at least)."""

    def __init__(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        half = len(x) // 2
        self.models = [build(name), build(name)]
        self.parts = [(x[:half], y[:half]), (x[half:], y[half:])]
        self.optimizer = torch.optim.SGD(self.models[0].parameters(), lr=1e-3)
        self.go = [threading.Event(), threading.Event()]
        self.done = [threading.Event(), threading.Event()]
        self.stop = False
        for i in range(2):
            threading.Thread(target=self._work, args=(i,), daemon=True, name=f"raw-half-{i}").start()

    def _work(self, i: int) -> None:
        torch.get_num_threads()  # its first parallel op would reset the count: take that first
        torch.set_num_threads(1)
        model, (x, y) = self.models[i], self.parts[i]
        while True:
            self.go[i].wait()
            self.go[i].clear()
            if self.stop:
                return
            model.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            self.done[i].set()

    def __call__(self) -> None:
        for event in self.go:
            event.set()
        for event in self.done:
            event.wait()
            event.clear()
        self.optimizer.step()

    def close(self) -> None:
        self.stop = True
        for event in self.go:
            event.set()


class Configs:
    """The in-process configurations of one model, built once (as a training loop would)."""

    def __init__(self, name: str) -> None:
        self.name = name
        x, y = batch(name, MODELS[name])
        bare, other, one, two = build(name), build(name), build(name), build(name)
        self.bare = make_step(bare, bare, x, y)
        self.other_bare = make_step(other, other, x, y)  # a second bare model: the noise floor of a pair
        self.one_device = make_step(multigpu.DataParallel(one, devices="cpu"), one, x, y)
        self.dp2_model = multigpu.DataParallel(two, devices="cpu:2")
        self.dp2 = make_step(self.dp2_model, two, x, y)
        self.x, self.y, self.dp2_params = x, y, two
        self.halves = RawHalves(name, x, y)


def round_of(c: Configs, steps: int) -> dict[str, float]:
    torch.set_num_threads(2)
    out = {"bare / bare (noise floor)": paired_ratio(c.other_bare, c.bare, steps)}
    out["1-dev DP / bare"] = paired_ratio(c.one_device, c.bare, steps)
    bare_ms = median_ms(c.bare, steps)
    dp2_ms = median_ms(c.dp2, steps)
    out["1-dev DP / bare, after cpu:2"] = paired_ratio(c.one_device, c.bare, steps)
    out["cpu:2 / 2 threads"] = dp2_ms / bare_ms
    out["raw halves / 2 threads (bound)"] = paired_ratio(c.halves, c.bare, steps)
    out["cpu:2 / raw halves (engine)"] = paired_ratio(c.dp2, c.halves, steps)
    out["bare ms"], out["cpu:2 ms"] = bare_ms, dp2_ms
    return out


def _ddp_worker(rank: int, name: str, port: int, steps: int, result: mp.Queue[float]) -> None:
    torch.set_num_threads(1)  # what multigpu launch gives each of 2 processes on 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    net = build(name)
    model = nn.parallel.DistributedDataParallel(net)
    x, y = batch(name, MODELS[name])
    half = len(x) // 2
    ms = median_ms(make_step(model, net, x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]), steps)
    result.put(ms)
    del model  # release DDP's reducer before the group goes (an abort at exit otherwise: pytorch#190489)
    gc.collect()
    dist.destroy_process_group()


def ddp_ms(name: str, steps: int) -> float:
    """The slower rank's median step of torch DDP over gloo, 2 spawned processes."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    result: mp.Queue[float] = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(rank, name, port, steps, result)) for rank in range(2)]
    for p in procs:
        p.start()
    ms = max(result.get(timeout=300), result.get(timeout=300))
    for p in procs:
        p.join(timeout=60)
    return ms


def bare_phases(c: Configs, steps: int) -> dict[str, float]:
    """Median ms of the bare step's forward, loss, backward and optimizer (2 threads)."""
    bare = build(c.name)
    opt = torch.optim.SGD(bare.parameters(), lr=1e-3)
    parts: dict[str, list[float]] = {"forward": [], "loss": [], "backward": [], "optimizer": []}
    for i in range(steps + 2):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = bare(c.x)
        t1 = time.perf_counter()
        loss = nn.functional.mse_loss(out, c.y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if i >= 2:
            for k, a, b in (("forward", t0, t1), ("loss", t1, t2), ("backward", t2, t3), ("optimizer", t3, t4)):
                parts[k].append((b - a) * 1e3)
    return {k: statistics.median(v) for k, v in parts.items()}


def dp_phases(c: Configs, steps: int) -> list[tuple[str, str, float]]:
    """(phase, device, median ms) of the cpu:2 step, from the project's step profiler."""
    from multigpu.profiling.step import ProfileConfig, profile_steps

    opt = torch.optim.SGD(c.dp2_params.parameters(), lr=1e-3)
    config = ProfileConfig(warmup=2, devices=["cpu:0", "cpu:1"])
    with profile_steps(c.dp2_model, optimizer=opt, config=config) as prof:
        for _ in range(steps + 2):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(c.dp2_model(c.x), c.y).backward()
            opt.step()
    profile = prof.profile()
    rows = [
        (name, dev, profile.median_seconds(name, dev) * 1e3)
        for name in profile.phase_names()
        for dev in profile.devices
        if any(p.phase == name and p.device == dev for s in profile.steps for p in s.phases)
    ]
    rows.append(("step (wall)", "", profile.median_step_s() * 1e3))
    return rows


def trace(c: Configs, folder: Path) -> list[Path]:
    """torch.profiler Chrome traces of a few bare and cpu:2 steps."""
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for label, step in (("bare", c.bare), ("cpu2", c.dp2)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        path = folder / f"step-{c.name}-{label}.json"
        prof.export_chrome_trace(str(path))
        written.append(path)
    return written


def thread_cpu_ms(step: Step, steps: int) -> list[tuple[str, float]]:
    """CPU ms per step of each thread of this process over ``steps`` steps (Linux ``/proc``), largest first:
    who burns the cores (an OpenMP team thread spinning while its leader waits shows up here)."""

    def now() -> dict[str, int]:
        ticks = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            except FileNotFoundError:  # the thread ended
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks[tid] = int(fields[11]) + int(fields[12])  # utime + stime
        return ticks

    step()
    before = now()
    for _ in range(steps):
        step()
    after = now()
    ms_per_tick = 1e3 / os.sysconf("SC_CLK_TCK")
    main = str(threading.get_native_id())
    rows = [
        ("caller" if tid == main else tid, (ticks - before.get(tid, 0)) * ms_per_tick / steps)
        for tid, ticks in after.items()
    ]
    return sorted((row for row in rows if row[1] > 0.05), key=lambda row: -row[1])


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP processes (the slowest part)")
    parser.add_argument("--trace", type=Path, help="write torch.profiler Chrome traces here")
    parser.add_argument("--thread-cpu", action="store_true", help="CPU ms per thread of a cpu:2 step (Linux)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    console = Console()
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    console.print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, revision {revision}, loadavg before: {loadavg()}")
    names = args.models.split(",")
    configs = {name: Configs(name) for name in names}
    samples: dict[tuple[str, str], list[float]] = {}
    with console.status("measuring") as status:
        for r in range(args.rounds):
            for name in names:
                status.update(f"round {r + 1}/{args.rounds}: {name}")
                for key, value in round_of(configs[name], args.steps).items():
                    samples.setdefault((name, key), []).append(value)
                if not args.no_ddp:
                    status.update(f"round {r + 1}/{args.rounds}: {name}, DDP")
                    ddp = ddp_ms(name, args.steps)
                    samples.setdefault((name, "DDP ms"), []).append(ddp)
                    samples.setdefault((name, "cpu:2 / DDP gloo x2"), []).append(samples[name, "cpu:2 ms"][-1] / ddp)
    table = Table(title=f"Step-time ratios, median of {args.rounds} interleaved rounds of {args.steps} steps")
    for col in ("model", "ratio", "median", "rounds (min-max)", "target", "met"):
        table.add_column(col, justify="left" if col in ("model", "ratio") else "right")
    for (name, key), values in samples.items():
        target = TARGETS.get((name, key))
        med = statistics.median(values)
        met = "-" if target is None else "yes" if med <= target else "NO"
        spread = f"{min(values):.3f}-{max(values):.3f}"
        table.add_row(name, key, f"{med:.3f}", spread, f"<= {target:.2f}" if target else "", met)
    console.print(table)
    for name in names:
        bare = bare_phases(configs[name], args.steps)
        console.print(
            f"{name}: bare step, 2 threads (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in bare.items()),
            soft_wrap=True,
        )
        rows = dp_phases(configs[name], args.steps)
        console.print(
            f"{name}: cpu:2 step by phase (ms): " + ", ".join(f"{p}{'@' + d if d else ''} {v:.2f}" for p, d, v in rows),
            soft_wrap=True,
        )
        if args.thread_cpu:
            cpu = thread_cpu_ms(configs[name].dp2, args.steps)
            console.print(f"{name}: cpu:2 step, CPU ms per thread: " + ", ".join(f"{t} {v:.2f}" for t, v in cpu))
        if args.trace:
            console.print(f"traces: {', '.join(map(str, trace(configs[name], args.trace)))}")
    for config in configs.values():
        config.halves.close()
    console.print(f"loadavg after: {loadavg()}")


if __name__ == "__main__":
    main()
