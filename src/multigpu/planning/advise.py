"""The answer: every strategy at every device count, and the one to use, with its reason.

Example:
    >>> from multigpu.planning import hardware, models
    >>> from multigpu.planning.platform import gpu_platform
    >>> g = hardware.gpu("titan-rtx")
    >>> rows = evaluate(models.workload("gpt2-124m", g), gpu_platform(g, hardware.link("nvlink-titan-rtx")), [1, 2], 4)
    >>> recommend(rows).strategy
    'ddp'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from multigpu.errors import ConfigError
from multigpu.planning.costs import StepTime, predict_step
from multigpu.planning.memory import device_memory
from multigpu.planning.platform import Platform
from multigpu.planning.workload import Workload

MULTI_DEVICE = ("dataparallel", "dataparallel-balanced", "ddp")
LABELS = {
    "single": "single device",
    "dataparallel": "DataParallel",
    "dataparallel-balanced": "balanced DataParallel",
    "ddp": "DDP",
}


@dataclass(frozen=True)
class Row:
    """One strategy at one device count."""

    step: StepTime
    memory: list[float]  # peak bytes per device
    fits: bool
    efficiency: float  # throughput / (devices * single-device throughput)

    @property
    def strategy(self) -> str:
        return self.step.strategy

    @property
    def devices(self) -> int:
        return self.step.devices


@dataclass(frozen=True)
class Recommendation:
    strategy: str
    devices: int
    sentence: str


def _row(strategy: str, w: Workload, plat: Platform, devices: int, batch: int, single_tput: float | None) -> Row:
    step = predict_step(strategy, w, plat, devices=devices, per_device_batch=batch)
    mem = device_memory(strategy, w, plat, step.chunks)
    fits = plat.memory_bytes is None or max(mem) <= plat.memory_bytes
    base = single_tput if single_tput is not None else step.throughput
    return Row(step, mem, fits, step.throughput / (devices * base))


def evaluate(w: Workload, plat: Platform, device_counts: Sequence[int], per_device_batch: int) -> list[Row]:
    """Predict every strategy at every device count (1 device: the single-device baseline).

    Raises:
        ConfigError: an empty or non-positive device count list.
    """
    if not device_counts or min(device_counts) < 1:
        raise ConfigError(
            f"device counts {list(device_counts)} must be a non-empty list of integers >= 1, e.g. 1,2,4,8"
        )
    single = _row("single", w, plat, 1, per_device_batch, None)
    rows = [single]
    for n in sorted(set(device_counts) - {1}):
        for strategy in MULTI_DEVICE:
            if strategy != "ddp" and not plat.single_process(n):
                continue  # one process cannot span nodes
            rows.append(_row(strategy, w, plat, n, per_device_batch, single.step.throughput))
    return rows


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def recommend(rows: Sequence[Row], memory_limit: float | None = None) -> Recommendation:
    """The fastest strategy that fits at the largest device count, in one sentence with its numbers."""
    top = max(r.devices for r in rows)
    candidates = [r for r in rows if r.devices == top]
    fitting = sorted((r for r in candidates if r.fits), key=lambda r: r.step.total_s)
    if not fitting:
        smallest = min(candidates, key=lambda r: max(r.memory))
        limit = f" > {_gb(memory_limit)} per device" if memory_limit else ""
        return Recommendation(
            "none",
            top,
            f"Nothing fits on {top} devices: the smallest peak is {_gb(max(smallest.memory))} "
            f"({LABELS[smallest.strategy]}){limit}; lower the per-device batch or use a larger device.",
        )
    best = fitting[0]
    sentence = (
        f"Use {LABELS[best.strategy]} on {top} device{'s' if top > 1 else ''}: "
        f"{best.step.total_s * 1e3:.1f} ms per step, {best.step.throughput:,.0f} samples/s, "
        f"{best.efficiency:.0%} scaling efficiency, peak {_gb(max(best.memory))} per device"
    )
    others = [r for r in candidates if r is not best]
    if others:
        runner = min(others, key=lambda r: r.step.total_s)
        why = (
            "does not fit"
            if not runner.fits
            else f"{runner.step.total_s * 1e3:.1f} ms, {runner.step.total_s / best.step.total_s:.2f}x slower"
        )
        sentence += f"; {LABELS[runner.strategy]} {why}"
    return Recommendation(best.strategy, top, sentence + ".")


def plot_throughput(rows: Sequence[Row], path: str | Path, title: str) -> Path:
    """Write a PNG of predicted throughput against device count, one line per strategy."""
    from multigpu.report.figures import pyplot, save_figure

    single = next(r for r in rows if r.strategy == "single")
    fig, ax = pyplot().subplots(figsize=(6.4, 4.0), dpi=120)
    counts = sorted({r.devices for r in rows})
    ax.plot(counts, [single.step.throughput * n for n in counts], ":", color="grey", label="linear scaling")
    for strategy in MULTI_DEVICE:
        pts = [(1, single.step.throughput)] + [(r.devices, r.step.throughput) for r in rows if r.strategy == strategy]
        if len(pts) > 1:
            ax.plot(*zip(*pts), marker="o", label=LABELS[strategy])
        for r in rows:
            if r.strategy == strategy and not r.fits:
                ax.plot(r.devices, r.step.throughput, "x", color="red", markersize=10)
    ax.set_xlabel("devices")
    ax.set_ylabel("predicted samples / s")
    ax.set_xticks(counts)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
