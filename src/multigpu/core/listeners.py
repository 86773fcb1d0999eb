"""What an engine reports while it runs, and to whom: phases of a step and replica scopes.

An engine (``multigpu.DataParallel``) owns one :class:`Listeners` set. Objects are attached to it
explicitly (``model.add_listener(profiler)``, undone by the returned handle) and hear:

- **phases**: ``begin(name, device)`` / ``end(token, nbytes)`` around every phase of a step
  (:data:`PHASES`), from whichever thread runs it (replica phases from the replica's thread);
- **replica scopes**: ``replica_scope(label, device)`` entered on the replica's own thread around
  that replica's forward or backward (the memory tracker counts what is allocated inside it).

A listener implements either or both. Nothing here is process-wide: a model nobody attached to
reports to nobody, and then a mark costs one attribute read and an empty context.

The interface lives here, below both the engine (which reports) and :mod:`multigpu.profiling`
(which listens), so that neither imports the other for it.

Example:
    >>> listeners = Listeners()
    >>> with listeners.phase("scatter", "cpu:0", nbytes=64):   # nobody attached: free
    ...     pass
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

PHASES = ("scatter", "replicate", "forward", "gather", "backward", "reduce", "optimizer")


@runtime_checkable
class PhaseListener(Protocol):
    """Hears the start and end of every phase (``end`` also runs when the phase raises)."""

    def begin(self, name: str, device: str | None) -> object: ...

    def end(self, token: object, nbytes: int) -> None: ...


@runtime_checkable
class ReplicaListener(Protocol):
    """Gets a context entered on each replica's thread around its work (``label``: e.g. ``"cpu:1"``)."""

    def replica_scope(self, label: str, device: torch.device) -> contextlib.AbstractContextManager[Any]: ...


Listener = PhaseListener | ReplicaListener

# Shared by every mark while nobody listens: no object is built per call (benchmarks/profile_overhead.py).
_IDLE: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


class ListenerHandle:
    """What :meth:`Listeners.add` returns: :meth:`remove` (or leaving its ``with`` block) detaches."""

    def __init__(self, owner: Listeners | None, listener: Listener) -> None:
        self._owner, self._listener = owner, listener

    def remove(self) -> None:
        """Detach the listener (safe to call twice)."""
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._remove(self._listener)

    def __enter__(self) -> ListenerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Listeners:
    """The listeners attached to one engine, and the marks the engine sends them.

    Attaching and detaching swap immutable tuples under a lock, so the replica threads that
    read them mid-step always see a whole set.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attached: tuple[Listener, ...] = ()
        self._phase: tuple[PhaseListener, ...] = ()
        self._replica: tuple[ReplicaListener, ...] = ()

    def add(self, listener: Listener) -> ListenerHandle:
        """Attach ``listener`` until the handle is removed (attaching it twice is one attachment)."""
        if not isinstance(listener, (PhaseListener, ReplicaListener)):
            raise TypeError(
                f"{type(listener).__name__} is not a listener: give it begin(name, device) and "
                "end(token, nbytes) for phases, or replica_scope(label, device) for replica work"
            )
        with self._lock:
            if any(listener is known for known in self._attached):
                return ListenerHandle(None, listener)
            self._set((*self._attached, listener))
        return ListenerHandle(self, listener)

    def _remove(self, listener: Listener) -> None:
        with self._lock:
            self._set(tuple(known for known in self._attached if known is not listener))

    def _set(self, attached: tuple[Listener, ...]) -> None:
        self._attached = attached
        self._phase = tuple(x for x in attached if isinstance(x, PhaseListener))
        self._replica = tuple(x for x in attached if isinstance(x, ReplicaListener))

    @property
    def active(self) -> bool:
        """Whether a phase listener is attached (the engine skips counting bytes otherwise)."""
        return bool(self._phase)

    @contextlib.contextmanager
    def isolated(self) -> Iterator[None]:
        """Inside the block only listeners attached inside it hear anything (the auto-balancer's probe step)."""
        with self._lock:
            saved = self._attached
            self._set(())
        try:
            yield
        finally:
            with self._lock:
                self._set(saved)

    def phase(self, name: str, device: str | None = None, nbytes: int = 0) -> contextlib.AbstractContextManager[None]:
        """Mark one phase of a step; ``nbytes`` is what it moved between devices.

        Example:
            >>> with Listeners().phase("gather", "cpu:0", nbytes=4096):
            ...     pass
        """
        listeners = self._phase
        if not listeners:
            return _IDLE
        return _Phase(listeners, name, device, nbytes)

    def replica_scope(self, label: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Every replica listener's scope for replica ``label``, entered on the calling (replica) thread."""
        listeners = self._replica
        if not listeners:
            return _IDLE
        if len(listeners) == 1:
            return listeners[0].replica_scope(label, device)
        return _all_scopes(listeners, label, device)


@contextlib.contextmanager
def _all_scopes(listeners: tuple[ReplicaListener, ...], label: str, device: torch.device) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for listener in listeners:
            stack.enter_context(listener.replica_scope(label, device))
        yield


class _Phase:
    """One listened-to phase: ``begin`` in attach order on enter, ``end`` in reverse on exit."""

    __slots__ = ("_device", "_listeners", "_name", "_nbytes", "_tokens")

    def __init__(self, listeners: tuple[PhaseListener, ...], name: str, device: str | None, nbytes: int) -> None:
        self._listeners, self._name, self._device, self._nbytes = listeners, name, device, nbytes

    def __enter__(self) -> None:
        self._tokens = [listener.begin(self._name, self._device) for listener in self._listeners]

    def __exit__(self, *_: object) -> None:
        for listener, token in zip(reversed(self._listeners), reversed(self._tokens)):
            listener.end(token, self._nbytes)
