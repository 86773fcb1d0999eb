"""The numbers a step profile holds, as plain dataclasses that round-trip through JSON.

One :class:`StepRecord` per profiled step: its wall time, and for every (phase, device) the
seconds spent, how often the phase ran and the bytes it moved. Communication phases
(:data:`COMM_PHASES`) also give the achieved bandwidth. Peak memory per device is data
(``{"cpu:0": bytes, ...}``) from whatever memory source the profiler was given.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from multigpu.core.listeners import PHASES

COMM_PHASES = ("scatter", "replicate", "gather", "reduce")
OTHER = "other"  # step time on a device outside every named phase (loss, data, Python, waiting)


@dataclass
class PhaseStat:
    """One phase on one device within one step."""

    phase: str
    device: str
    seconds: float
    calls: int = 1
    nbytes: int = 0

    @property
    def gbps(self) -> float | None:
        """Achieved GB/s (1e9 bytes per second) of a communication phase; None for compute phases."""
        if self.phase not in COMM_PHASES or self.seconds <= 0 or self.nbytes == 0:
            return None
        return self.nbytes / self.seconds / 1e9


@dataclass
class StepRecord:
    """One training step: wall time, per-phase stats and per-device peak memory."""

    index: int
    wall_s: float
    phases: list[PhaseStat]
    peak_bytes: dict[str, int] = field(default_factory=dict)

    def seconds(self, phase: str, device: str) -> float:
        return sum(p.seconds for p in self.phases if p.phase == phase and p.device == device)


@dataclass
class StepProfile:
    """A profile of several steps: what the report folder and the figures are drawn from.

    Example:
        >>> profile = StepProfile(devices=["cpu:0"], steps=[])
        >>> StepProfile.from_json(profile.to_json()).devices
        ['cpu:0']
    """

    devices: list[str]
    steps: list[StepRecord]
    timing: str = "host clock"  # or "<type> events" ("cuda events") where a device type times with events
    meta: dict[str, Any] = field(default_factory=dict)

    def phase_names(self) -> list[str]:
        """Phases that occur in this profile, in step order."""
        seen = {p.phase for s in self.steps for p in s.phases}
        return [name for name in PHASES if name in seen] + sorted(seen - set(PHASES))

    def median_seconds(self, phase: str, device: str) -> float:
        """Median over steps of the seconds ``phase`` took on ``device`` (0 where it did not run)."""
        if not self.steps:
            return 0.0
        return statistics.median(s.seconds(phase, device) for s in self.steps)

    def median_step_s(self) -> float:
        return statistics.median(s.wall_s for s in self.steps) if self.steps else 0.0

    def median_other_s(self, device: str) -> float:
        """Median step time minus the medians of ``device``'s phases (never negative).

        Defined on medians so that a device's phases plus "other" add up to the median step.
        """
        named = sum(self.median_seconds(name, device) for name in self.phase_names())
        return max(0.0, self.median_step_s() - named)

    def comm_stats(self) -> list[PhaseStat]:
        """Every communication phase of every step (for bandwidth against message size)."""
        return [p for s in self.steps for p in s.phases if p.phase in COMM_PHASES and p.nbytes > 0]

    def peak_bytes(self) -> dict[str, int]:
        """Highest peak per device over all steps (empty when no memory source was given)."""
        out: dict[str, int] = {}
        for step in self.steps:
            for device, value in step.peak_bytes.items():
                out[device] = max(out.get(device, 0), value)
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> StepProfile:
        raw = json.loads(text)
        steps = [
            StepRecord(
                index=s["index"],
                wall_s=s["wall_s"],
                phases=[PhaseStat(**p) for p in s["phases"]],
                peak_bytes={k: int(v) for k, v in s.get("peak_bytes", {}).items()},
            )
            for s in raw["steps"]
        ]
        return StepProfile(devices=raw["devices"], steps=steps, timing=raw["timing"], meta=raw.get("meta", {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def load(path: str | Path) -> StepProfile:
        return StepProfile.from_json(Path(path).read_text())
