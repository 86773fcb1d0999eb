"""The plan checked on this machine: measured strategies beside their predictions, and the answer from measurement.

``multigpu advise --measure`` runs a few timed steps of every strategy that fits the devices present,
each in its own process (:mod:`multigpu.launcher.measure` starts them; this layer never starts
processes). This module takes what they report (:class:`Measurement`), pairs each with the
predicted row of the same strategy and device count (:class:`Checked`), says how far off each
prediction was, and recommends from the measurements: the fastest strategy that ran, by samples
per second, fewer devices and then ddp over fsdp within 2% (the planner's own tie rule,
:data:`multigpu.planning.advise.TIE`). A strategy that failed (out of memory, an error, past its
share of the budget) is a row with its reason, never a recommendation.

Example:
    >>> ok = Measurement(strategy="single", devices=1, status="ok", step_s=0.010, samples_per_step=32)
    >>> recommend_measured(check([], [ok])).strategy
    'single'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from multigpu.core.units import binary_unit
from multigpu.planning.advise import TIE, Recommendation, Row
from multigpu.planning.costs import FSDP, PLANNED
from multigpu.report.figures import paired_bar_figure
from multigpu.report.tables import compact_table

STATUSES = ("ok", "failed", "out of memory", "timed out", "not run")


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one strategy's process measured (or why it measured nothing).

    Attributes:
        strategy: ``single``, ``dp``, ``ddp`` or ``fsdp``.
        devices: devices (dp replicas, or processes) it ran on.
        status: one of :data:`STATUSES`.
        reason: for a row that is not ``ok``, what happened (the error's last line, or the limit).
        step_s: seconds per optimizer step: the 25th percentile of the timed steps (each the slowest rank's).
        samples_per_step: samples of one step over all processes (None: not known).
        steps: timed steps behind the quantile.
        peak_bytes: peak bytes per device (one entry per device, or one per process).
        memory_source: where ``peak_bytes`` comes from ("allocation tracker", "CUDA allocator", ...).
        wall_s: seconds the process ran, start-up included.
    """

    strategy: str
    devices: int
    status: str = "ok"
    reason: str = ""
    step_s: float | None = None
    samples_per_step: int | None = None
    steps: int = 0
    peak_bytes: list[int] = field(default_factory=list)
    memory_source: str = ""
    wall_s: float = 0.0

    @property
    def samples_per_s(self) -> float | None:
        if self.step_s is None or not self.samples_per_step:
            return None
        return self.samples_per_step / self.step_s

    @property
    def ran(self) -> bool:
        return self.status == "ok" and self.step_s is not None


@dataclass(frozen=True)
class Checked:
    """A measurement and the prediction for the same strategy and device count (None: no prediction)."""

    measured: Measurement
    predicted: Row | None

    @property
    def time_error(self) -> float | None:
        """predicted / measured step time - 1 (+0.10: predicted 10% slower than measured)."""
        if self.predicted is None or not self.measured.ran or not self.measured.step_s:
            return None
        return self.predicted.step.total_s / self.measured.step_s - 1

    @property
    def memory_error(self) -> float | None:
        """predicted / measured peak of the fullest device - 1."""
        if self.predicted is None or not self.measured.ran or not self.measured.peak_bytes:
            return None
        measured = max(self.measured.peak_bytes)
        return max(self.predicted.memory) / measured - 1 if measured > 0 else None


def check(rows: Sequence[Row], measurements: Sequence[Measurement]) -> list[Checked]:
    """Each measurement with the predicted row of its strategy and device count (in the measurements' order)."""
    predicted = {(r.strategy, r.devices): r for r in rows}
    return [Checked(m, predicted.get((m.strategy, m.devices))) for m in measurements]


def recommend_measured(checked: Sequence[Checked]) -> Recommendation:
    """The measured row with the most samples per second (the shortest step where samples are not known).

    Within 2% of the best, fewer devices win, then ddp over fsdp. When nothing ran, the strategy is
    ``"none"`` and the sentence says why the first one failed.
    """
    ran = [c.measured for c in checked if c.measured.ran]
    if not ran:
        first = next((c.measured for c in checked), None)
        why = f" ({first.strategy} x{first.devices}: {first.status}, {first.reason})" if first else ""
        return Recommendation("none", 0, f"Nothing ran to the end{why}; raise --budget or lower the batch.")

    def speed(m: Measurement) -> float:
        return m.samples_per_s if m.samples_per_s is not None else 1.0 / (m.step_s or 1.0)

    top = max(speed(m) for m in ran)
    best = min((m for m in ran if speed(m) >= (1 - TIE) * top), key=lambda m: (m.devices, m.strategy == FSDP))
    plural = "s" if best.devices > 1 else ""
    rate = f", {best.samples_per_s:,.0f} samples/s" if best.samples_per_s is not None else ""
    sentence = f"Measured here: use {_label(best.strategy)} on {best.devices} device{plural}: "
    sentence += f"{(best.step_s or 0) * 1e3:.1f} ms per step{rate}"
    others = sorted((m for m in ran if m is not best), key=speed, reverse=True)
    if others:
        runner = others[0]
        sentence += f"; next {_label(runner.strategy)} on {runner.devices}: {speed(best) / speed(runner):.2f}x slower"
    failed = [c.measured for c in checked if not c.measured.ran]
    if failed:
        sentence += "; did not run: " + ", ".join(f"{m.strategy} x{m.devices} ({m.status})" for m in failed)
    return Recommendation(best.strategy, best.devices, sentence + ".")


def _label(strategy: str) -> str:
    return PLANNED[strategy].label if strategy in PLANNED else strategy


def _pct(error: float | None) -> str:
    return "-" if error is None else f"{error:+.0%}"


def measured_rows(checked: Sequence[Checked]) -> tuple[list[str], list[list[str]]]:
    """The table's columns and rows: measured and predicted step, their error, samples/s, peak memory."""
    peaks = [p for c in checked for p in c.measured.peak_bytes] + [
        max(c.predicted.memory) for c in checked if c.predicted is not None
    ]
    unit, size = binary_unit(max(peaks, default=1) or 1)
    columns = ["strategy", "N", "step ms", "pred ms", "error", "samples/s", f"peak {unit}", "pred", "status"]
    out = []
    for c in checked:
        m, p = c.measured, c.predicted
        out.append(
            [
                m.strategy,
                str(m.devices),
                f"{m.step_s * 1e3:.1f}" if m.ran and m.step_s is not None else "-",
                f"{p.step.total_s * 1e3:.1f}" if p is not None else "-",
                _pct(c.time_error),
                f"{m.samples_per_s:,.0f}" if m.ran and m.samples_per_s is not None else "-",
                "|".join(f"{b / size:.1f}" for b in m.peak_bytes[:2]) if m.ran and m.peak_bytes else "-",
                f"{max(p.memory) / size:.1f}" if p is not None else "-",
                m.status if m.ran else m.status.upper(),
            ]
        )
    return columns, out


def print_measured(console: Console, checked: Sequence[Checked], rec: Recommendation, budget_s: float) -> None:
    """The measured table, the failures with their reasons, and the recommendation from measurement."""
    console.print(
        f"Measured on this machine (25th-percentile step of each strategy's own process, budget {budget_s:.0f} s; "
        "error: predicted / measured - 1; peak of the fullest device, dp: primary|other)",
        soft_wrap=True,
    )
    console.print(compact_table(*measured_rows(checked)))
    for c in checked:
        if not c.measured.ran:
            console.print(f"  {c.measured.strategy} x{c.measured.devices}: {c.measured.reason}", soft_wrap=True)
    sources = sorted({c.measured.memory_source for c in checked if c.measured.ran and c.measured.memory_source})
    if sources:
        console.print(f"peak memory from: {', '.join(sources)}", soft_wrap=True)
    console.print(rec.sentence, soft_wrap=True)


def measured_json(checked: Sequence[Checked], rec: Recommendation, budget_s: float) -> dict[str, Any]:
    """The ``"measured"`` part of ``advise --measure --json``: one entry per strategy run, and the answer."""
    return {
        "budget_s": budget_s,
        "rows": [
            {
                "strategy": c.measured.strategy,
                "devices": c.measured.devices,
                "status": c.measured.status,
                "reason": c.measured.reason,
                "step_ms": c.measured.step_s * 1e3 if c.measured.step_s is not None else None,
                "samples_per_s": c.measured.samples_per_s,
                "steps": c.measured.steps,
                "peak_bytes": list(c.measured.peak_bytes),
                "memory_source": c.measured.memory_source,
                "wall_s": c.measured.wall_s,
                "predicted_step_ms": c.predicted.step.total_s * 1e3 if c.predicted is not None else None,
                "predicted_peak_bytes": [int(b) for b in c.predicted.memory] if c.predicted is not None else None,
                "step_error": c.time_error,
                "memory_error": c.memory_error,
            }
            for c in checked
        ],
        "recommendation": {"strategy": rec.strategy, "devices": rec.devices, "reason": rec.sentence},
    }


def plot_measured(checked: Sequence[Checked], path: str | Path, title: str) -> Path:
    """A PNG of measured and predicted samples per second, one pair of bars per strategy run
    (a failed run has no measured bar; its label says why)."""
    labels = [
        f"{c.measured.strategy} x{c.measured.devices}" + ("" if c.measured.ran else f"\n({c.measured.status})")
        for c in checked
    ]
    measured = [c.measured.samples_per_s if c.measured.ran else None for c in checked]
    predicted = [c.predicted.step.throughput if c.predicted is not None else None for c in checked]
    series = {"measured": measured, **({"predicted": predicted} if any(p is not None for p in predicted) else {})}
    return paired_bar_figure(labels, series, path, ylabel="samples / s", title=title)
