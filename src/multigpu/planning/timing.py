"""Timings that a loaded machine does not bend much: repeat, then keep a low quantile.

Other work on a shared machine only ever adds time to a probe, so the timings of one probe have a
floor and a long right tail. The fastest of them is the luckiest moment, one the measured run (the
median of its steps) rarely sees; the median is moved by a burst of load that lasts a few
repeats. The planner keeps the :data:`QUANTILE` (the 25th percentile) of :data:`REPEATS` (9)
timings after one warm-up call: the third fastest, so two disturbed-low or lucky timings and up to
six slowed ones leave it where it is, and it still reads the machine's typical quiet speed.

Example:
    >>> low_quantile([5.0, 1.0, 9.0, 2.0, 3.0, 8.0, 4.0, 7.0, 6.0])
    3.0
    >>> low_quantile([1.0, 100.0, 100.0, 100.0], q=0.25)
    1.0
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from multigpu.errors import ConfigError

REPEATS = 9  # timed calls per probe (after one warm-up): a second for a step of 0.1 s
QUANTILE = 0.25  # the kept one: the third fastest of 9


def low_quantile(values: Sequence[float], q: float = QUANTILE) -> float:
    """The ``q`` quantile of ``values`` by nearest rank, rounded down (``q=0``: the smallest).

    Raises:
        ConfigError: no values, or ``q`` outside [0, 1].
    """
    if not values:
        raise ConfigError("low_quantile of no timings: time the probe at least once (repeats >= 1)")
    if not 0.0 <= q <= 1.0:
        raise ConfigError(f"q={q} must be within [0, 1] (0.25: the 25th percentile)")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def quantile_s(fn: Callable[[], object], repeats: int = REPEATS, q: float = QUANTILE) -> float:
    """Seconds of one call of ``fn``: the ``q`` quantile of ``repeats`` timed calls after a warm-up."""
    if repeats < 1:
        raise ConfigError(f"repeats={repeats} must be >= 1")
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return low_quantile(times, q)
