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


class _FanOut:
    """Forwards every phase to several listeners: begin in order, end in reverse order."""

    def __init__(self, listeners: tuple[PhaseListener, ...]) -> None:
        self._listeners = listeners

    def begin(self, name: str, device: str | None) -> object:
        return tuple(listener.begin(name, device) for listener in self._listeners)

    def end(self, token: object, nbytes: int) -> None:
        tokens: tuple[object, ...] = token  # type: ignore[assignment]  # what begin() returned
        for listener, own in reversed(list(zip(self._listeners, tokens))):
            listener.end(own, nbytes)


def fan_out(*listeners: PhaseListener) -> PhaseListener:
    """One listener that feeds several, since :func:`listening` installs one at a time.

    Example: the step profiler and a per-replica memory tracker (which enters its tracking
    in the replica's own thread on ``begin("forward", "cpu:1")``) both hear every phase.

        >>> with listening(fan_out(profiler, tracker)):
        ...     model(x)
    """
    return listeners[0] if len(listeners) == 1 else _FanOut(listeners)


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


class _Phase:
    """One listened-to phase: ``begin`` on enter, ``end`` on exit (also when the block raises)."""

    __slots__ = ("_device", "_listener", "_name", "_nbytes", "_token")

    def __init__(self, listener: PhaseListener, name: str, device: str | None, nbytes: int) -> None:
        self._listener, self._name, self._device, self._nbytes = listener, name, device, nbytes

    def __enter__(self) -> None:
        self._token = self._listener.begin(self._name, self._device)

    def __exit__(self, *_: object) -> None:
        self._listener.end(self._token, self._nbytes)


# Shared by every phase while nobody listens: no generator or object is built per call, which
# keeps the idle cost of a mark at one global read and one function call (benchmarks/profile_overhead.py).
_IDLE: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def phase(name: str, device: str | None = None, nbytes: int = 0) -> contextlib.AbstractContextManager[None]:
    """Mark one phase of a step; ``nbytes`` is what the phase moved between devices.

    Example:
        >>> with phase("scatter", "cpu:0", nbytes=4096):
        ...     pass
    """
    listener = _listener
    if listener is None:
        return _IDLE
    return _Phase(listener, name, device, nbytes)
