"""The two-core CPU platform the cost tests plan on: no device memory, 10 GB/s memory, a 1 GB/s measured link,
no peer copies, no overlap. A test passes what it varies (contention, synchronous collectives, a step floor)."""

from __future__ import annotations

from typing import Any

from multigpu.planning import hardware
from multigpu.planning.hardware import Platform


def two_core_cpu(**fields: Any) -> Platform:
    """A CPU :class:`Platform` of 2 cores; ``fields`` override or add to the defaults above."""
    defaults: dict[str, Any] = {
        "name": "cpu",
        "memory_bytes": None,
        "memory_bandwidth": 10e9,
        "link": hardware.measured_link(1e9),
        "peer_copies": False,
        "overlap": 0.0,
        "cores": 2,
    }
    return Platform(**{**defaults, **fields})
