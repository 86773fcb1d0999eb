"""Rich tables for step profiles, bandwidth probes and DDP profiles (numbers a person reads), and the
generic pieces other reports fill with their rows: a compact table, counts and byte units."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from functools import partial

from rich import box
from rich.table import Table

from multigpu.core.units import format_bytes, format_ms
from multigpu.profiling.bandwidth import BandwidthPoint
from multigpu.profiling.ddp import DDPProfile
from multigpu.profiling.records import COMM_PHASES, OTHER, StepProfile

_ms = partial(format_ms, unit="")  # in columns headed "ms"


def human_count(n: float) -> str:
    """``124_439_808`` -> ``'124.4 M'``; small counts keep their digits.

    Example:
        >>> human_count(5_234)
        '5.2 k'
    """
    for suffix, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {suffix}"
    return f"{n:.0f}"


def compact_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> Table:
    """A table that fits 80 columns, also when piped: a simple head, no edge padding, nothing wrapped;
    the first column left-aligned (names), the others right-aligned (numbers)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def phase_table(profile: StepProfile) -> Table:
    """Median milliseconds per step for every phase on every device, with the step time."""
    title = f"Time per step by phase and device (median of {len(profile.steps)} steps, ms; {profile.timing})"
    table = Table(title=title, min_width=len(title))
    table.add_column("phase")
    for device in profile.devices:
        table.add_column(device, justify="right")
    for name in profile.phase_names():
        ran = {p.device for s in profile.steps for p in s.phases if p.phase == name}
        table.add_row(name, *(_ms(profile.median_seconds(name, d)) if d in ran else "-" for d in profile.devices))
    table.add_row(f"{OTHER} (outside phases)", *(_ms(profile.median_other_s(d)) for d in profile.devices), style="dim")
    table.add_row("step (wall)", *([_ms(profile.median_step_s())] * len(profile.devices)), style="bold")
    return table


def comm_table(profile: StepProfile) -> Table:
    """Bytes moved per step by each communication phase and the bandwidth it achieved."""
    table = Table(title="Communication per step (median)", min_width=60)
    for column, justify in (
        ("phase", "left"),
        ("device", "left"),
        ("bytes", "right"),
        ("ms", "right"),
        ("GB/s", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for name in COMM_PHASES:
        for device in profile.devices:
            stats = [p for s in profile.steps for p in s.phases if p.phase == name and p.device == device]
            if not stats:
                continue
            stats.sort(key=lambda p: p.seconds)
            mid = stats[len(stats) // 2]
            gbps = f"{mid.gbps:.2f}" if mid.gbps is not None else "-"
            table.add_row(name, device, format_bytes(mid.nbytes), _ms(mid.seconds), gbps)
    return table


def memory_table(peaks: dict[str, int]) -> Table:
    """Peak memory per device, with each device's share of the largest."""
    table = Table(title="Peak memory per device", min_width=40)
    table.add_column("device")
    table.add_column("peak", justify="right")
    table.add_column("vs max", justify="right")
    top = max(peaks.values(), default=0) or 1
    for device, value in peaks.items():
        table.add_row(device, format_bytes(value), f"{100 * value / top:.0f}%")
    return table


def bandwidth_table(points: Sequence[BandwidthPoint]) -> Table:
    """One row per probe and message size: time, algbw and busbw (nccl-tests definitions)."""
    table = Table(title="Bandwidth (GB/s = 1e9 B/s; busbw as nccl-tests)")
    for column in ("probe", "size", "time (us)", "algbw GB/s", "busbw GB/s"):
        table.add_column(column, justify="left" if column == "probe" else "right")
    order = {probe: i for i, probe in enumerate(dict.fromkeys(p.probe for p in points))}
    for p in sorted(points, key=lambda p: (order[p.probe], p.nbytes)):
        table.add_row(p.probe, format_bytes(p.nbytes), f"{p.seconds * 1e6:.1f}", f"{p.algbw:.2f}", f"{p.busbw:.2f}")
    return table


def ddp_table(profile: DDPProfile) -> Table:
    """Per rank: median step time, time in all-reduce, busy time, bytes reduced and GB/s."""
    table = Table(title=f"DDP per rank (median over steps; backend {profile.backend})", min_width=80)
    for column in ("rank", "step ms", "all-reduce ms", "busy ms", "reduced / step", "buckets", "GB/s"):
        table.add_column(column, justify="right")
    for r in profile.ranks:
        allreduce = statistics.median(r.allreduce_s) if r.allreduce_s else 0.0
        nbytes = statistics.median(r.allreduce_bytes) if r.allreduce_bytes else 0
        gbps = f"{nbytes / allreduce / 1e9:.2f}" if allreduce > 0 else "-"
        step = statistics.median(r.step_s) if r.step_s else 0.0
        buckets = str(max(r.buckets, default=0))
        table.add_row(str(r.rank), _ms(step), _ms(allreduce), _ms(r.busy_s()), format_bytes(nbytes), buckets, gbps)
    table.caption = profile.straggler().describe() if profile.ranks else ""
    return table
