"""The plan as a person reads it: a table that fits 80 columns (also when piped), and one sentence.

Numbers keep their real size: a 5 k-parameter model shows ``5.2 k params`` and its peak in KiB,
not ``0.0M`` and ``0 MB``. DataParallel rows show the primary and the other devices apart
(``primary | others``): the primary carries the optimizer state and the gathered outputs.

Example:
    >>> human_count(5_234)
    '5.2 k'
"""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from multigpu.planning.advise import Recommendation, Row
from multigpu.planning.platform import Platform
from multigpu.planning.workload import Workload
from multigpu.report.tables import format_bytes

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def human_count(n: float) -> str:
    """``124_439_808`` -> ``'124.4 M'``; small counts keep their digits."""
    for suffix, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {suffix}"
    return f"{n:.0f}"


def _unit(rows: Sequence[Row]) -> tuple[str, int]:
    peak = max(max(r.memory) for r in rows)
    return next((name, size) for name, size in _UNITS if peak >= size or size == 1)


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


def plan_table(rows: Sequence[Row], plat: Platform) -> Table:
    """strategy, devices, samples per device, step ms, samples/s, scaling, peak memory, fits."""
    unit, size = _unit(rows)
    limit = f"/{plat.memory_bytes / size:.0f}" if plat.memory_bytes else ""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("strategy", "N", "batch/dev", "step ms", "samples/s", "scaling", f"peak {unit}{limit}", "fits"):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r.strategy,
            str(r.devices),
            _chunks(r.step.chunks),
            _ms(r.step.total_s),
            f"{r.step.throughput:,.0f}",
            f"{r.efficiency:.0%}",
            _memory(r.memory, size),
            "yes" if r.fits else "NO",
        )
    return table


def breakdown(row: Row) -> str:
    """Where one step's time goes, largest first (ms)."""
    parts = sorted(((v, k) for k, v in row.step.parts.items() if v * 1e3 >= 0.05), reverse=True)
    return f"  {row.strategy} x{row.devices} (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for v, k in parts)


def print_plan(console: Console, w: Workload, plat: Platform, rows: Sequence[Row], rec: Recommendation) -> None:
    """The table, what it was computed from, the recommendation and the breakdown of the top rows."""
    console.print(f"Predicted step on {plat.name} (dp rows: primary|others)", soft_wrap=True)
    console.print(plan_table(rows, plat))
    console.print(
        f"inputs: {w.name}, {human_count(w.params)} params, {w.compute_s_per_sample * 1e3:.3g} ms/sample compute, "
        f"{format_bytes(w.activation_bytes_per_sample)} activations and {format_bytes(w.output_bytes_per_sample)} "
        f"outputs per sample, {w.optimizer} {w.precision}",
        soft_wrap=True,
    )
    console.print(rec.sentence, soft_wrap=True)
    top = max(r.devices for r in rows)
    for r in rows:
        if r.devices == top and r.strategy in ("dp", "ddp", "fsdp"):
            console.print(breakdown(r), soft_wrap=True)
