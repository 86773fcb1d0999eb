"""The answer: every strategy at every device count, the one to use with its reason, as JSON, table and figure.

The planned rows are the cost model's (:data:`multigpu.planning.costs.PLANNED`, each a strategy of
:mod:`multigpu.strategies`). The table fits 80 columns (also when piped) and numbers keep their
real size: a 5 k-parameter model shows ``5.2 k params`` and its peak in KiB, not ``0.0M`` and ``0 MB``. DataParallel rows show the
primary and the other devices apart (``primary | others``): the primary carries the optimizer state
and the gathered outputs. The table and figure are drawn by :mod:`multigpu.report`; this module
supplies their rows.

Example:
    >>> from multigpu.planning.hardware import gpu, gpu_platform, link
    >>> from multigpu.planning.workload import from_preset
    >>> g = gpu("titan-rtx")
    >>> rows = evaluate(from_preset("gpt2-124m", g), gpu_platform(g, link("nvlink-titan-rtx")), [1, 2], 4)
    >>> recommend(rows).strategy
    'ddp'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from multigpu.core.units import binary_unit, format_bytes
from multigpu.errors import ConfigError
from multigpu.parallel.scatter_gather import even_chunk_sizes
from multigpu.planning.costs import DDP, DP, FSDP, PLANNED, SINGLE, StepTime, device_memory, predict_step
from multigpu.planning.hardware import Platform
from multigpu.planning.workload import Workload
from multigpu.report.figures import Line, line_figure
from multigpu.report.tables import compact_table, human_count

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

    single = _row(SINGLE, w, plat, split(1), None)
    rows = [single]
    for n in sorted(set(device_counts) - {1}):
        for strategy in (s for s in PLANNED.values() if s.multi_device):
            if strategy.one_process and not plat.single_process(n):
                continue  # one process cannot span nodes
            given_split = chunk_sizes is not None and strategy.name == DP
            sizes = list(chunk_sizes) if given_split else split(n)  # type: ignore[arg-type]
            rows.append(_row(strategy.name, w, plat, sizes, single.step.throughput))
    return rows


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
            f"Nothing fits: the smallest peak is {format_bytes(max(smallest.memory))} ({_label(smallest.strategy)} "
            f"on {smallest.devices}){limit}; lower the batch or use a larger device.",
        )
    top = max(r.step.throughput for r in fitting)
    best = min(
        (r for r in fitting if r.step.throughput >= (1 - TIE) * top),
        key=lambda r: (r.devices, r.strategy == FSDP, r.step.total_s),
    )
    plural = "s" if best.devices > 1 else ""
    sentence = (
        f"Use {_label(best.strategy)} on {best.devices} device{plural}: {best.step.total_s * 1e3:.1f} ms per step, "
        f"{best.step.throughput:,.0f} samples/s, {best.efficiency:.0%} scaling efficiency, "
        f"peak {format_bytes(max(best.memory))} per device"
    )
    others = [r for r in rows if r is not best and r.devices == max(x.devices for x in rows)]
    if others:
        runner = max(others, key=lambda r: (r.fits, r.step.throughput))  # the fastest fitting, else the fastest
        why = "does not fit" if not runner.fits else f"{runner.step.throughput:,.0f} samples/s"
        if not (best.strategy == FSDP and runner.strategy == DDP and runner.devices == best.devices):
            sentence += f"; {_label(runner.strategy)} on {runner.devices}: {why}"  # else _why_fsdp speaks for ddp
    return Recommendation(best.strategy, best.devices, sentence + "." + _why_fsdp(best, rows) + _slower_than_one(rows))


def _why_fsdp(best: Row, rows: Sequence[Row]) -> str:
    """Why fsdp was chosen: DDP does not fit on that many devices, or is predicted slower."""
    if best.strategy != FSDP:
        return ""
    ddp = next((r for r in rows if r.strategy == DDP and r.devices == best.devices), None)
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
    single = next((r for r in rows if r.strategy == SINGLE), None)
    slower = [
        r.devices
        for r in rows
        if single is not None and r.strategy == DP and r.step.throughput < single.step.throughput
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
                "parts_ms": {name: seconds * 1e3 for name, seconds in r.step.parts.items()},
                "samples_per_s": r.step.throughput,
                "scaling": r.efficiency,
                "peak_bytes": [int(m) for m in r.memory],
                "fits": r.fits,
            }
            for r in rows
        ],
        "recommendation": {"strategy": rec.strategy, "devices": rec.devices, "reason": rec.sentence},
    }


def _label(strategy: str) -> str:
    return PLANNED[strategy].label


def plot_throughput(rows: Sequence[Row], path: str | Path, title: str) -> Path:
    """Write a PNG of predicted throughput against device count, one line per strategy."""
    single = next(r for r in rows if r.strategy == SINGLE)
    counts = sorted({r.devices for r in rows})
    lines = [Line(counts, [single.step.throughput * n for n in counts], "linear scaling", _LINEAR)]
    for strategy in (s.name for s in PLANNED.values() if s.multi_device):
        pts = [(1, single.step.throughput)] + [(r.devices, r.step.throughput) for r in rows if r.strategy == strategy]
        if len(pts) > 1:
            dashed = strategy == FSDP  # often on top of ddp: dashed and hollow, so both show
            style = {"linestyle": "--", "marker": "D", "markerfacecolor": "none"} if dashed else _SOLID
            x, y = zip(*pts)
            lines.append(Line(x, y, f"{strategy} ({_label(strategy)})", style))
        lines += [
            Line([r.devices], [r.step.throughput], None, _NO_FIT) for r in rows if r.strategy == strategy and not r.fits
        ]
    return line_figure(lines, path, xlabel="devices", ylabel="predicted samples / s", title=title, xticks=counts)


_LINEAR = {"linestyle": ":", "color": "grey"}
_SOLID = {"linestyle": "-", "marker": "o"}
_NO_FIT = {"linestyle": "none", "marker": "x", "color": "red", "markersize": 10}


def _chunks(chunks: tuple[int, ...]) -> str:
    if len(set(chunks)) == 1:
        return str(chunks[0])
    others = chunks[1:]
    rest = str(others[0]) if len(set(others)) == 1 else f"{min(others)}-{max(others)}"
    return f"{chunks[0]}|{rest}"


def _memory(memory: list[float], size: int) -> str:
    digits = 1 if max(memory) / size >= 10 else 2
    if len(memory) == 1 or len({round(m / size, digits) for m in memory}) == 1:
        return f"{memory[0] / size:.{digits}f}"
    return f"{memory[0] / size:.{digits}f}|{max(memory[1:]) / size:.{digits}f}"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 1000 else f"{ms:.1f}" if ms >= 1 else f"{ms:.3f}"


def plan_rows(rows: Sequence[Row], plat: Platform) -> tuple[list[str], list[list[str]]]:
    """The plan table's columns and rows: strategy, devices, samples per device, step ms, samples/s,
    scaling, peak memory (in one unit for the column, of the device's memory when known), fits."""
    unit, size = binary_unit(max(max(r.memory) for r in rows))
    limit = f"/{plat.memory_bytes / size:.0f}" if plat.memory_bytes else ""
    columns = ["strategy", "N", "batch/dev", "step ms", "samples/s", "scaling", f"peak {unit}{limit}", "fits"]
    return columns, [
        [
            r.strategy,
            str(r.devices),
            _chunks(r.step.chunks),
            _ms(r.step.total_s),
            f"{r.step.throughput:,.0f}",
            f"{r.efficiency:.0%}",
            _memory(r.memory, size),
            "yes" if r.fits else "NO",
        ]
        for r in rows
    ]


def breakdown(row: Row) -> str:
    """Where one step's time goes, largest first (ms)."""
    parts = sorted(((v, k) for k, v in row.step.parts.items() if v * 1e3 >= 0.05), reverse=True)
    return f"  {row.strategy} x{row.devices} (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for v, k in parts)


def print_plan(console: Console, w: Workload, plat: Platform, rows: Sequence[Row], rec: Recommendation) -> None:
    """The table, what it was computed from, the recommendation and the breakdown of the top rows."""
    console.print(f"Predicted step on {plat.name} (dp rows: primary|others)", soft_wrap=True)
    console.print(compact_table(*plan_rows(rows, plat)))
    console.print(
        f"inputs: {w.name}, {human_count(w.params)} params, {w.compute_s_per_sample * 1e3:.3g} ms/sample compute, "
        f"{format_bytes(w.activation_bytes_per_sample)} activations and {format_bytes(w.output_bytes_per_sample)} "
        f"outputs per sample, {w.optimizer} {w.precision}",
        soft_wrap=True,
    )
    console.print(rec.sentence, soft_wrap=True)
    top = max(r.devices for r in rows)
    for r in rows:
        if r.devices == top and r.strategy in (DP, DDP, FSDP):
            console.print(breakdown(r), soft_wrap=True)
