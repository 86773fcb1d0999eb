"""Write a report folder: summary tables (terminal and text), raw JSON, PNG figures.

Layout of ``DIR`` after :func:`write_profile_report`:

    summary.txt      the tables printed in the terminal
    profile.json     the raw step profile (StepProfile.to_json)
    phases.png       stacked time per phase per device
    memory.png       peak memory per device (when a memory source was given)
    bandwidth.png    probe curves, with this run's communication phases as points
    bandwidth.json   the probe points (when probes ran)

and of ``DIR`` after :func:`write_ddp_report`: ddp.json and ddp.png (busy and all-reduce time per rank).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from rich.console import Console, RenderableType

from multigpu.profiling.bandwidth import BandwidthPoint
from multigpu.profiling.ddp import DDPProfile
from multigpu.profiling.records import StepProfile
from multigpu.report import figures, tables


def write_profile_report(
    out_dir: str | Path,
    profile: StepProfile,
    *,
    bandwidth: Sequence[BandwidthPoint] = (),
    console: Console | None = None,
    memory_hint: str = "memory=track_memory() to profile_steps",
) -> list[Path]:
    """Render ``profile`` (and optional probe points) into ``out_dir`` and print the summary.

    Args:
        out_dir: the report folder (created).
        profile: a real profile from :class:`~multigpu.profiling.step.StepProfiler`.
        bandwidth: probe points drawn under the profile's achieved bandwidth.
        console: where the tables are printed (default: the terminal).
        memory_hint: what to pass to measure memory, shown when the profile has none
            (``multigpu profile`` says ``--memory``).

    Returns:
        The files written.

    Example:
        >>> write_profile_report("profile-out", prof.profile())  # doctest: +SKIP
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recorder = Console(record=True, width=120, file=io.StringIO())  # a text copy of the tables
    shown: list[RenderableType] = [tables.phase_table(profile)]
    if profile.comm_stats():
        shown.append(tables.comm_table(profile))
    peaks = profile.peak_bytes()
    shown.append(tables.memory_table(peaks) if peaks else _no_memory_note(profile, memory_hint))
    for renderable in shown:
        (console or Console()).print(renderable)
        recorder.print(renderable)
    written = [out / "summary.txt", out / "profile.json"]
    written[0].write_text(recorder.export_text())
    profile.save(written[1])
    written.append(figures.phase_figure(profile, out / "phases.png"))
    if peaks:
        written.append(figures.memory_figure(peaks, out / "memory.png"))
    if bandwidth or profile.comm_stats():
        written.append(figures.bandwidth_figure(bandwidth, out / "bandwidth.png", achieved=profile.comm_stats()))
    if bandwidth:
        written.append(write_bandwidth_json(bandwidth, out / "bandwidth.json"))
    return written


def write_ddp_report(out_dir: str | Path, profile: DDPProfile, *, console: Console | None = None) -> list[Path]:
    """Print the per-rank table and write ``ddp.json`` and ``ddp.png`` (call on one rank, e.g. rank 0).

    Example:
        >>> profile = prof.gather()                      # every rank
        >>> if rank == 0: write_ddp_report("profile-out", profile)  # doctest: +SKIP
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (console or Console()).print(tables.ddp_table(profile))
    (out / "ddp.json").write_text(profile.to_json())
    return [out / "ddp.json", figures.ddp_figure(profile, out / "ddp.png")]


def write_bandwidth_json(points: Sequence[BandwidthPoint], path: str | Path) -> Path:
    """Probe points with their derived algbw and busbw, as a JSON list."""
    rows = [{**asdict(p), "algbw_gbps": p.algbw, "busbw_gbps": p.busbw} for p in points]
    out = Path(path)
    out.write_text(json.dumps(rows, indent=2))
    return out


def _no_memory_note(profile: StepProfile, hint: str) -> str:
    if profile.meta.get("memory"):  # a tracker ran, but saw no replica: on CPU it counts DataParallel's replicas
        return (
            "[dim]Peak memory: the memory source reported none (on CPU devices the tracker counts what "
            "DataParallel replicas allocate, and none ran in the kept steps).[/dim]"
        )
    return f"[dim]Peak memory: not measured; pass {hint} to measure it.[/dim]"
