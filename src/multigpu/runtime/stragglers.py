"""The slow rank named: which rank sets the pace of a multi-process run, and whether compute or data holds it.

Under ddp or fsdp every step waits for the slowest rank. A rank that is slow rather than stuck (a
throttled GPU, a noisy neighbour on its cores, a loader that decodes slower on one node) drags every
step to its pace, and its own clock does not show it: the others' steps take as long, spent waiting.
So each rank times its *own* share of each step, the step's wall time less the time it spent inside
multigpu's collectives (:mod:`multigpu.runtime.waits`: a fast rank waits there for the slow one),
split into the wait for its next batch (data wait) and the rest (compute). Note the gradient all-reduce
of ``session.backward`` counts as a collective whole: a rank's backward compute is in nobody's own time,
so a rank slow only inside backward is not told apart (a slow device is slow in forward too).

Every :data:`WINDOW_STEPS` optimizer steps the ranks exchange one small tensor (each rank's typical compute
and data wait per step in nanoseconds: the mean over its fastest :data:`KEPT` of the window's steps; one
all-gather through ``collectives.agree``, so through ``issuing``) and the main process compares them: the
slowest rank's own time over the median of the others' is its ratio. The fastest quarter, because what a
loaded machine does to a step (a descheduled process, a late wake-up, a first log's import, a save) only
adds time, and to some steps: a rank slow in every step (a throttled device, a slower loader) is slow in its
fastest steps too, while a healthy rank's fastest steps are as fast as the others'. At :data:`SLOW_RATIO`
or more the slowest rank is reported once on the main process's stderr, with its split against the
others', and written to the run folder for ``multigpu launch``'s end-of-run summary
(:mod:`multigpu.launcher.slow_ranks` reads it). The threshold is below 1.2 so that a rank 1.2x slower is
named although part of its own time is not slowed (the loop's own Python, a healthy loader): a rank
throttled to 1.2x measured 1.17-1.25 on a loaded 2-core machine, where healthy ranks measured 1.00-1.03
(once 1.125, at load 19, in steps of 20 ms).
A rank is also not named when its extra time is under :data:`MIN_SHARE` of the step: where the backward
and its all-reduce make most of the step, the own times are a fraction of a millisecond, their ratio moves
with a loaded core's noise (1.19x and 1.23x over 0.5-1 ms in a healthy 13 ms step), and such a rank costs
the run less than 2%.

Example::

    watch = StragglerWatch(main=True)
    verdict = watch.add(step, compute_s=0.010, data_wait_s=0.001)   # every rank, at every optimizer step
    if verdict is not None: print(verdict.slowest, verdict.ratio)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from multigpu.core.run_files import write_replacing
from multigpu.runtime import collectives, world
from multigpu.runtime.agreement import Call

WINDOW_STEPS = 50  # optimizer steps per comparison: one exchange each, and the horizon of a report
KEPT = 0.25  # a rank's typical step: the mean of its fastest quarter of a window's steps (load only adds time)
SLOW_RATIO = 1.15  # a rank this much slower than the median of the others is reported (names a 1.2x rank)
MIN_SHARE = 0.02  # and its extra time is this share of the step or more: a ratio of small own times is noise
RECORD_PATTERN = "slow-rank-attempt-*.json"  # what the main process leaves the launcher
_REPORTS = itertools.count(1)  # this process's reports, for their files' names
_CALL = Call("exchange of each rank's step times (slow-rank watch)", ())


@dataclass(frozen=True)
class RankTimes:
    """One rank's own time per step over a window, in seconds: compute and data wait (collective waits left out)."""

    compute_s: float
    data_wait_s: float

    @property
    def own_s(self) -> float:
        return self.compute_s + self.data_wait_s


@dataclass(frozen=True)
class Verdict:
    """One window compared: every rank's times (by rank), the slowest rank and its ratio."""

    first_step: int  # the window's optimizer steps, counted from 1 (the first, untimed, is never in one)
    last_step: int
    times: tuple[RankTimes, ...]
    slowest: int
    ratio: float  # slowest rank's own time / the median of the others'
    step_s: float = 0.0  # the main process's median step (wall time) over the window: the scale of the times

    @property
    def slow(self) -> bool:
        """At :data:`SLOW_RATIO` or more, and its extra time at least :data:`MIN_SHARE` of the step (when known)."""
        mine = self.times[self.slowest].own_s
        extra = mine - mine / self.ratio if self.ratio > 0 else 0.0  # its own time over the others' median
        return self.ratio >= SLOW_RATIO and (self.step_s <= 0 or extra >= MIN_SHARE * self.step_s)

    def message(self) -> str:
        """The report of a slow rank: who, how much, and its data wait against its compute."""
        mine = self.times[self.slowest]
        others = [t for rank, t in enumerate(self.times) if rank != self.slowest]
        compute = statistics.median(t.compute_s for t in others)
        wait = statistics.median(t.data_wait_s for t in others)
        cause = (
            "its data loading (more loader workers, faster storage on its node)"
            if mine.data_wait_s - wait > mine.compute_s - compute
            else "its compute (a throttled or shared device, other processes on its cores)"
        )
        scale = f" (steps of {_ms(self.step_s)})" if self.step_s > 0 else ""
        return (
            f"multigpu: rank {self.slowest} is slow: {self.ratio:.2f}x the median of the other ranks over "
            f"optimizer steps {self.first_step}-{self.last_step}{scale}; per step, rank {self.slowest}: compute "
            f"{_ms(mine.compute_s)} + data wait {_ms(mine.data_wait_s)}, the others' median: "
            f"compute {_ms(compute)} + data wait {_ms(wait)}. Every rank waits for it; look at "
            f"{cause} (docs/measuring.md, section 'The slow rank')"
        )


def compare(times: list[RankTimes], first_step: int, last_step: int, step_s: float = 0.0) -> Verdict:
    """The window's verdict: the rank with the most own time, over the median of the others' (2+ ranks).

    Example:
        >>> v = compare([RankTimes(1.0, 0.0), RankTimes(1.3, 0.0), RankTimes(1.1, 0.0)], 1, 50)
        >>> v.slowest, round(v.ratio, 3)
        (1, 1.238)
    """
    slowest = max(range(len(times)), key=lambda rank: times[rank].own_s)
    median = statistics.median(t.own_s for rank, t in enumerate(times) if rank != slowest)
    ratio = times[slowest].own_s / median if median > 0 else 1.0
    return Verdict(first_step, last_step, tuple(times), slowest, ratio, step_s)


def typical_step(steps: list[tuple[float, float]]) -> RankTimes:
    """The mean (compute, data wait) of the fastest :data:`KEPT` of ``steps`` (by their sum; at least one step).

    Example:
        >>> typical_step([(0.01, 0.0)] * 3 + [(0.5, 0.0)] * 5)   # a rank slowed in 5 of 8 steps: not in its fastest
        RankTimes(compute_s=0.01, data_wait_s=0.0)
    """
    kept = sorted(steps, key=sum)[: max(1, round(len(steps) * KEPT))]
    return RankTimes(sum(c for c, _ in kept) / len(kept), sum(w for _, w in kept) / len(kept))


class StragglerWatch:
    """Every rank's own step times, compared every ``window`` optimizer steps. Every rank must call :meth:`add`.

    Args:
        main: this is the main process (it reports, and writes the launcher's record).
        window: optimizer steps per exchange.
    """

    def __init__(self, *, main: bool, window: int = WINDOW_STEPS) -> None:
        self.main = main
        self.window = window
        self.latest: Verdict | None = None  # the last window's verdict
        self.reported: Verdict | None = None  # the slow window reported (once a run)
        self._window: list[tuple[float, float]] = []  # this window's (compute, data wait) per step
        self._walls: list[float] = []  # this window's steps' wall times

    def add(self, step: int, *, compute_s: float, data_wait_s: float, wall_s: float = 0.0) -> Verdict | None:
        """Count optimizer step ``step``'s own time (of a step of ``wall_s``); at the window's end exchange and
        compare (a collective)."""
        self._window.append((compute_s, data_wait_s))
        self._walls.append(wall_s)
        if len(self._window) < self.window:
            return None
        own, step_s = typical_step(self._window), statistics.median(self._walls)
        self._window, self._walls = [], []
        mine = [round(own.compute_s * 1e9), round(own.data_wait_s * 1e9)]  # nanoseconds: int64 travels exactly
        rows = collectives.agree(_CALL, mine).tolist()  # one all-gather of a 32-number header; a sync point
        times = [RankTimes(compute_ns / 1e9, wait_ns / 1e9) for compute_ns, wait_ns in rows]
        verdict = compare(times, step - self.window + 1, step, step_s)
        self.latest = verdict
        if verdict.slow and self.reported is None and self.main:
            self.reported = verdict
            print(verdict.message(), file=sys.stderr, flush=True)
            _leave_for_launcher(verdict)
        return verdict


def _leave_for_launcher(verdict: Verdict) -> None:
    """The report, in the run folder ``multigpu launch`` reads after the run (nothing outside a launch); one
    file per report: a script's second Session (each reports once) does not overwrite the first's."""
    folder = world.failure_dir()
    if folder is None:
        return
    record = {
        "rank": verdict.slowest,
        "ratio": verdict.ratio,
        "step_s": verdict.step_s,
        "first_step": verdict.first_step,
        "last_step": verdict.last_step,
        "times": [asdict(t) for t in verdict.times],
        "message": verdict.message(),
    }
    with contextlib.suppress(OSError):  # the stderr report stands; the summary goes without it
        name = f"slow-rank-attempt-{world.restart_count()}-{next(_REPORTS)}.json"
        write_replacing(Path(folder) / name, json.dumps(record))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
