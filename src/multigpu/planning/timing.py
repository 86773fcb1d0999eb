"""Timings that a loaded machine does not bend much: repeat, then keep a low quantile.

Other work on a shared machine only ever adds time to a probe, so the timings of one probe have a
floor and a long right tail. The fastest of them is the luckiest moment, one the measured run (the
median of its steps) rarely sees; the median is moved by a burst of load that lasts a few
repeats. The planner keeps the :data:`QUANTILE` (the 25th percentile) of :data:`REPEATS` (9)
timings after one warm-up call: the third fastest, so two disturbed-low or lucky timings and up to
six slowed ones leave it where it is, and it still reads the machine's typical quiet speed.

Two more rules keep a probe steady when other processes hold the cores. A call much longer than
the scheduler's time slice (a few ms) is interrupted every time, so that no quantile of its wall
time is quiet: such calls on one thread are timed by that thread's CPU time (:data:`CPU_CLOCK`);
calls that use several threads or wait on other processes are kept short (below a slice) and
repeated more (:data:`SHORT_REPEATS`).

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
# A ratio of two timings taken in the same round (a slowdown, a speed-up) cancels a load that lasts the
# round: the median of the rounds' ratios. Another quantile reads the quiet machine's spread as a bias
# (the 25th percentile of the contention and the 75th of the speed-up made every plan fast).
RATIO_QUANTILE = 0.5
SHORT_REPEATS = 25  # timed calls of a probe kept below the scheduler's slice (the host costs, the collectives)
# A collective between two processes waits until both hold a core, and nothing makes it faster than
# that: the second fastest of SHORT_REPEATS. Three probes at load 11-12 read fsdp's all-gather and
# reduce-scatter at 0.12-0.26 GB/s as the 25th percentile of 25, two at load 7-11 at 0.26 as this one.
WAIT_QUANTILE = 0.08
# The CPU time of the calling thread (user and system: page faults included). A call that runs on one
# thread only (one intra-op thread, no waits on other threads) costs the same CPU time however long
# other processes keep it off the cores: at load 12 on the 2 development cores a one-thread training
# step of the benchmark's MLP read 8.6-8.8 ms of CPU time in three calibrations, against 33-45 ms wall.
CPU_CLOCK = time.thread_time


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


def quantile_s(
    fn: Callable[[], object],
    repeats: int = REPEATS,
    q: float = QUANTILE,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds of one call of ``fn``: the ``q`` quantile of ``repeats`` timed calls after a warm-up.

    ``clock``: wall time (the default), or :func:`time.thread_time` for a call that runs on this
    thread alone (:data:`CPU_CLOCK`).
    """
    if repeats < 1:
        raise ConfigError(f"repeats={repeats} must be >= 1")
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return low_quantile(times, q)
