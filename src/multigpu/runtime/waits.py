"""How long this thread has spent inside multigpu's collectives: the time a rank waited for the others.

Every collective multigpu issues passes :func:`multigpu.runtime.collectives.issuing`, which times its
block here (the outermost block only, when they nest). Under ddp the ranks meet at every step (the
gradient all-reduce of ``session.backward`` counts as one collective), so a fast rank spends the slow
rank's extra time waiting in one: a step's time minus its collectives' is the rank's own
(:mod:`multigpu.runtime.stragglers`). Kept per thread: a collective on another thread (a background
save) does not stall the training loop's.

Example:
    >>> before = collective_seconds()
    >>> with timing():
    ...     pass
    >>> collective_seconds() >= before
    True
"""

from __future__ import annotations

import threading
import time

_local = threading.local()


def collective_seconds() -> float:
    """Seconds the calling thread has spent inside collectives since it started (a running total)."""
    return float(getattr(_local, "total", 0.0))


class _Timing:
    """The block's time added to :func:`collective_seconds`, once for nested blocks (a class: a generator-based
    context manager costs several microseconds more, on every collective)."""

    def __enter__(self) -> None:
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        if depth == 0:
            _local.began = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1
        if _local.depth == 0:
            _local.total = getattr(_local, "total", 0.0) + time.perf_counter() - _local.began


_TIMING = _Timing()


def timing() -> _Timing:
    """A context manager adding its block's time to :func:`collective_seconds` (not again for nested blocks)."""
    return _TIMING
