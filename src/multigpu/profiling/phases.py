"""Phase hooks for the engines: where a step's time goes, at no cost when nobody listens.

The engines wrap each phase of a step in ``with phase("scatter", device=..., nbytes=...)``.
With no :class:`PhaseListener` installed this is one global read and an empty context.
A profiler installs a listener with :func:`listening`; the listener decides what to measure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

PHASES = ("scatter", "replicate", "forward", "gather", "backward", "reduce", "optimizer")


class PhaseListener(Protocol):
    """Receives the start and end of every phase while installed."""

    def begin(self, name: str, device: str | None) -> object: ...

    def end(self, token: object, nbytes: int) -> None: ...


_listener: PhaseListener | None = None


@contextlib.contextmanager
def listening(listener: PhaseListener) -> Iterator[PhaseListener]:
    """Install ``listener`` for the duration of the block (one at a time, process-wide)."""
    global _listener
    previous, _listener = _listener, listener
    try:
        yield listener
    finally:
        _listener = previous


def active() -> bool:
    """Whether a listener is installed (engines skip computing byte counts otherwise)."""
    return _listener is not None


@contextlib.contextmanager
def phase(name: str, device: str | None = None, nbytes: int = 0) -> Iterator[None]:
    """Mark one phase of a step; ``nbytes`` is what the phase moved between devices."""
    listener = _listener
    if listener is None:
        yield
        return
    token = listener.begin(name, device)
    try:
        yield
    finally:
        listener.end(token, nbytes)
