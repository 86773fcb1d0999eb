"""PNG figures (matplotlib, Agg backend: no display needed) for profiles and bandwidth probes, and
a line figure other reports fill with their series.

matplotlib is imported on the first figure, not with this module: every ``multigpu`` command
imports it, and pyplot alone would add about 0.3 s to ``multigpu launch``'s start.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from multigpu.core.units import format_bytes
from multigpu.profiling.bandwidth import BandwidthPoint
from multigpu.profiling.ddp import DDPProfile
from multigpu.profiling.records import OTHER, PhaseStat, StepProfile

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")  # must precede pyplot's first import
    import matplotlib.pyplot as plt

    return plt


_COLORS = {
    "scatter": "#4c72b0",
    "replicate": "#64b5cd",
    "forward": "#55a868",
    "gather": "#8172b2",
    "backward": "#c44e52",
    "reduce": "#dd8452",
    "optimizer": "#937860",
    OTHER: "#cccccc",
}


def phase_figure(profile: StepProfile, path: str | Path) -> Path:
    """Stacked bars: median ms per step in each phase, one bar per device (grey: outside phases).

    Returns:
        The written path.
    """
    fig, ax = pyplot().subplots(figsize=(max(4.0, 1.6 * len(profile.devices) + 2.5), 4.2))
    names = [*profile.phase_names(), OTHER]
    bottoms = [0.0] * len(profile.devices)
    for name in names:
        if name == OTHER:
            values = [profile.median_other_s(d) * 1e3 for d in profile.devices]
        else:
            values = [profile.median_seconds(name, d) * 1e3 for d in profile.devices]
        ax.bar(profile.devices, values, bottom=bottoms, label=name, color=_COLORS.get(name))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.axhline(profile.median_step_s() * 1e3, color="black", linestyle="--", linewidth=1, label="step (wall)")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"Where each step's time goes ({len(profile.steps)} steps, {profile.timing})")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return save_figure(fig, path)


def memory_figure(peaks: Mapping[str, int], path: str | Path) -> Path:
    """Bars: peak memory per device in MiB (the primary's extra share shows as a taller bar)."""
    fig, ax = pyplot().subplots(figsize=(max(4.0, 1.2 * len(peaks) + 2.0), 3.8))
    devices = list(peaks)
    ax.bar(devices, [peaks[d] / 2**20 for d in devices], color="#4c72b0")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("Peak memory per device")
    return save_figure(fig, path)


def bandwidth_figure(points: Sequence[BandwidthPoint], path: str | Path, *, achieved: Sequence[PhaseStat] = ()) -> Path:
    """Bus bandwidth against message size, one line per probe (log-log); dots: a profile's phases."""
    from matplotlib.ticker import FuncFormatter

    fig, ax = pyplot().subplots(figsize=(7.5, 4.5))
    for probe in dict.fromkeys(p.probe for p in points):
        line = sorted((p for p in points if p.probe == probe), key=lambda p: p.nbytes)
        ax.plot([p.nbytes for p in line], [p.busbw for p in line], marker="o", markersize=3, label=probe)
    for name in dict.fromkeys(s.phase for s in achieved):
        rates = [(s.nbytes, s.gbps) for s in achieved if s.phase == name and s.gbps is not None]
        ax.scatter(
            [n for n, _ in rates],
            [g for _, g in rates],
            marker="x",
            color=_COLORS.get(name),
            label=f"{name} (this run)",
        )
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_bytes(x).replace(".0 ", " ")))
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("Bandwidth against message size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


@dataclass(frozen=True)
class Line:
    """One series of :func:`line_figure`: its points, its legend entry (None: none), matplotlib's style."""

    x: Sequence[float]
    y: Sequence[float]
    label: str | None = None
    style: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"linestyle": "--", "marker": "D"}


def line_figure(
    lines: Sequence[Line], path: str | Path, *, xlabel: str, ylabel: str, title: str, xticks: Sequence[float] = ()
) -> Path:
    """Lines drawn in order on one grid, with a legend of the labelled ones; returns the written path."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.0), dpi=120)
    for line in lines:
        ax.plot(line.x, line.y, label=line.label, **line.style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if xticks:
        ax.set_xticks(list(xticks))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def paired_bar_figure(
    labels: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    path: str | Path,
    *,
    ylabel: str,
    title: str,
) -> Path:
    """Bars side by side per label, one colour per series (``None``: no bar, e.g. a run that failed)."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.0), dpi=120)
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width=width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Lay out ``fig``, write it as a PNG at ``path`` (folders created) and close it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return out


def ddp_figure(profile: DDPProfile, path: str | Path) -> Path:
    """Stacked bars per rank: busy time and time in all-reduce (median ms per step)."""
    import statistics

    fig, ax = pyplot().subplots(figsize=(max(4.0, 1.2 * len(profile.ranks) + 2.5), 4.0))
    labels = [f"rank {r.rank}" for r in profile.ranks]
    busy = [r.busy_s() * 1e3 for r in profile.ranks]
    allreduce = [statistics.median(r.allreduce_s) * 1e3 if r.allreduce_s else 0.0 for r in profile.ranks]
    ax.bar(labels, busy, label="busy (step - all-reduce)", color="#55a868")
    ax.bar(labels, allreduce, bottom=busy, label="all-reduce (incl. waiting)", color="#dd8452")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(profile.straggler().describe(), fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
