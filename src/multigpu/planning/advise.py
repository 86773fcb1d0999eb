"""The answer: every strategy at every device count, the one to use with its reason, and its JSON.

Strategy names are the Session's: ``single``, ``dp``, ``dp-balanced`` (DataParallel with chunk
sizes that even out memory), ``ddp`` and ``fsdp``.

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
from typing import Any

from multigpu.errors import ConfigError
from multigpu.parallel.scatter_gather import even_chunk_sizes
from multigpu.planning.costs import StepTime, predict_step
from multigpu.planning.memory import device_memory
from multigpu.planning.platform import Platform
from multigpu.planning.workload import Workload

MULTI_DEVICE = ("dp", "dp-balanced", "ddp", "fsdp")
MULTI_PROCESS = ("ddp", "fsdp")  # the strategies that can span nodes
LABELS = {
    "single": "single device",
    "dp": "DataParallel",
    "dp-balanced": "balanced DataParallel",
    "ddp": "DDP",
    "fsdp": "FSDP",
}
# Within this share of the best throughput, fewer devices win, and then ddp over fsdp: the planner
# cannot tell them apart, and the simpler set-up is the better bet.
TIE = 0.02


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
    strategy: str  # one of the row strategies, or "none" when nothing fits
    devices: int
    sentence: str


def _row(strategy: str, w: Workload, plat: Platform, chunks: Sequence[int], single_tput: float | None) -> Row:
    step = predict_step(strategy, w, plat, chunks=chunks)
    mem = device_memory(strategy, w, plat, step.chunks)
    fits = plat.memory_bytes is None or max(mem) <= plat.memory_bytes
    base = single_tput if single_tput is not None else step.throughput
    return Row(step, mem, fits, step.throughput / (step.devices * base))


def evaluate(
    w: Workload,
    plat: Platform,
    device_counts: Sequence[int],
    per_device_batch: int | None = None,
    *,
    global_batch: int | None = None,
    chunk_sizes: Sequence[int] | None = None,
) -> list[Row]:
    """Predict every strategy at every device count (1 device: the single-device baseline).

    Pass exactly one batch: ``per_device_batch`` (every device gets it: weak scaling),
    ``global_batch`` (split evenly, as DataParallel does: strong scaling; one device runs all of
    it), or ``chunk_sizes`` (one DataParallel split to plan, e.g. ``[4, 19, 19, 18]``: the dp row
    uses it, dp-balanced and ddp split its sum their own way; ``device_counts`` is ignored).

    Raises:
        ConfigError: not exactly one batch, an empty or non-positive device count list, a batch
            smaller than a device count.
    """
    given = [x is not None for x in (per_device_batch, global_batch, chunk_sizes)]
    if sum(given) != 1:
        raise ConfigError("pass exactly one of --batch (per device), --global-batch and --chunk-sizes")
    if chunk_sizes is not None:
        if not chunk_sizes or min(chunk_sizes) < 1:
            raise ConfigError(f"chunk sizes {list(chunk_sizes)} must be >= 1 each, e.g. 4,19,19,18")
        device_counts = [1, len(chunk_sizes)]
    if not device_counts or min(device_counts) < 1:
        raise ConfigError(
            f"device counts {list(device_counts)} must be a non-empty list of integers >= 1, e.g. 1,2,4,8"
        )
    total = sum(chunk_sizes) if chunk_sizes is not None else global_batch

    def split(n: int) -> list[int]:
        if total is None:
            return [per_device_batch or 0] * n
        if total < n:
            raise ConfigError(
                f"global batch {total} is smaller than {n} devices; raise --global-batch or use fewer devices"
            )
        return even_chunk_sizes(total, n)

    single = _row("single", w, plat, split(1), None)
    rows = [single]
    for n in sorted(set(device_counts) - {1}):
        for strategy in MULTI_DEVICE:
            if strategy not in MULTI_PROCESS and not plat.single_process(n):
                continue  # one process cannot span nodes
            given_split = chunk_sizes is not None and strategy == "dp"
            rows.append(_row(strategy, w, plat, list(chunk_sizes) if given_split else split(n), single.step.throughput))  # type: ignore[arg-type]
    return rows


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point: 512 B, 3.4 MiB, 24.7 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"


def recommend(rows: Sequence[Row], memory_limit: float | None = None) -> Recommendation:
    """The fitting row with the highest throughput, in one sentence with its numbers.

    Single device is a candidate like any other, so a strategy predicted slower than one device is
    never recommended; among rows within 2% of the best, the fewest devices win, then ddp over
    fsdp. So fsdp is recommended where ddp does not fit (the sentence says so), or where it is
    predicted faster than ddp by more than 2%; never where ddp fits and is predicted faster.
    """
    fitting = [r for r in rows if r.fits]
    if not fitting:
        smallest = min(rows, key=lambda r: max(r.memory))
        limit = f" > {format_bytes(memory_limit)} per device" if memory_limit else ""
        return Recommendation(
            "none",
            smallest.devices,
            f"Nothing fits: the smallest peak is {format_bytes(max(smallest.memory))} ({LABELS[smallest.strategy]} "
            f"on {smallest.devices}){limit}; lower the batch or use a larger device.",
        )
    top = max(r.step.throughput for r in fitting)
    best = min(
        (r for r in fitting if r.step.throughput >= (1 - TIE) * top),
        key=lambda r: (r.devices, r.strategy == "fsdp", r.step.total_s),
    )
    plural = "s" if best.devices > 1 else ""
    sentence = (
        f"Use {LABELS[best.strategy]} on {best.devices} device{plural}: {best.step.total_s * 1e3:.1f} ms per step, "
        f"{best.step.throughput:,.0f} samples/s, {best.efficiency:.0%} scaling efficiency, "
        f"peak {format_bytes(max(best.memory))} per device"
    )
    others = [r for r in rows if r is not best and r.devices == max(x.devices for x in rows)]
    if others:
        runner = max(others, key=lambda r: (r.fits, r.step.throughput))  # the fastest fitting, else the fastest
        why = "does not fit" if not runner.fits else f"{runner.step.throughput:,.0f} samples/s"
        if not (best.strategy == "fsdp" and runner.strategy == "ddp" and runner.devices == best.devices):
            sentence += f"; {LABELS[runner.strategy]} on {runner.devices}: {why}"  # else _why_fsdp speaks for ddp
    return Recommendation(best.strategy, best.devices, sentence + "." + _why_fsdp(best, rows) + _slower_than_one(rows))


def _why_fsdp(best: Row, rows: Sequence[Row]) -> str:
    """Why fsdp was chosen: DDP does not fit on that many devices, or is predicted slower."""
    if best.strategy != "fsdp":
        return ""
    ddp = next((r for r in rows if r.strategy == "ddp" and r.devices == best.devices), None)
    if ddp is None:
        return ""
    if not ddp.fits:
        return (
            f" DDP does not fit on {ddp.devices} devices (peak {format_bytes(max(ddp.memory))} per device); FSDP "
            "shards the parameters, gradients and optimizer state over them."
        )
    return (
        f" FSDP is predicted faster than DDP here ({ddp.step.throughput:,.0f} samples/s): each device steps "
        "the optimizer on its shard only."
    )


def _slower_than_one(rows: Sequence[Row]) -> str:
    """A sentence naming the device counts where DataParallel is predicted slower than one device."""
    single = next((r for r in rows if r.strategy == "single"), None)
    slower = [
        r.devices
        for r in rows
        if single is not None and r.strategy == "dp" and r.step.throughput < single.step.throughput
    ]
    if not slower:
        return ""
    counts = ", ".join(map(str, slower))
    return f" DataParallel is slower than one device on {counts} devices: its host work (replicate, forwards through one GIL) outgrows the work per device."


def to_json(rows: Sequence[Row], rec: Recommendation, inputs: dict[str, Any]) -> dict[str, Any]:
    """The plan as plain data: ``{"inputs", "rows", "recommendation"}`` (the schema of ``advise --json``)."""
    return {
        "inputs": inputs,
        "rows": [
            {
                "strategy": r.strategy,
                "devices": r.devices,
                "batch_per_device": list(r.step.chunks),
                "step_ms": r.step.total_s * 1e3,
                "samples_per_s": r.step.throughput,
                "scaling": r.efficiency,
                "peak_bytes": [int(m) for m in r.memory],
                "fits": r.fits,
            }
            for r in rows
        ],
        "recommendation": {"strategy": rec.strategy, "devices": rec.devices, "reason": rec.sentence},
    }


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
            dashed = strategy == "fsdp"  # often on top of ddp: dashed and hollow, so both show
            ax.plot(
                *zip(*pts),
                linestyle="--" if dashed else "-",
                marker="D" if dashed else "o",
                markerfacecolor="none" if dashed else None,
                label=f"{strategy} ({LABELS[strategy]})",
            )
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
