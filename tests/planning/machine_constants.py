"""This machine's planner constants for tests: fixed figures of its order, written where advise reads them.

``tests/conftest.py`` fills the session's cache folder with them, so a CPU plan in a test (and in the
processes it starts) reads them instead of measuring the machine; the tests of the probe and of
``--recalibrate`` measure or replace them on purpose.
"""

from __future__ import annotations

from pathlib import Path

from multigpu.planning.hardware import DEFAULT_HOST
from multigpu.planning.machine import MachineConstants, machine_key, save

FIXED_SOURCE = "fixed by the tests (tests/planning/machine_constants.py)"


def fixed(**changes: object) -> MachineConstants:
    figures: dict[str, object] = {
        "key": machine_key(),
        "host": DEFAULT_HOST,
        "memory_bandwidth": 10e9,
        "thread_overhead_s": 50e-6,
        "allreduce_latency_s": 300e-6,
        "allreduce_busbw": 0.5e9,
        "gather_latency_s": 1e-3,
        "gather_busbw": 0.3e9,
        "fresh_copy_bandwidth": 5e9,
        "source": FIXED_SOURCE,
    }
    return MachineConstants(**{**figures, **changes})  # type: ignore[arg-type]


def fill(folder: Path) -> Path:
    """Write :func:`fixed` constants for this machine into ``folder``; the file's path."""
    return save(fixed(), folder)
