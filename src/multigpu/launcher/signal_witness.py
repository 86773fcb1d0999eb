"""A worker's witness of the signal that ends it: recorded with its time, then the process dies of it as usual.

A rank stopped by ``kill -TERM`` (a user, a scheduler) while the others wait in a collective leaves no
error, only an exit by a signal, and so does every rank the launcher's agent stops with SIGTERM once it
saw a failure: without more, the launcher cannot tell the rank the signal came to first from the ones
it stopped itself, and blamed a rank that only waited. :func:`install` (run by
:mod:`multigpu.launcher._entry` before the script) makes each worker record the SIGTERM or SIGHUP that
ends it, with the time it arrived (:func:`multigpu.runtime.failure_records.record_signal`), so
:mod:`multigpu.launcher.root_cause` names the rank stopped first, by which signal.

Why a thread: Python runs a signal handler only between two bytecodes of the main thread, which a
worker waiting in gloo or NCCL, or in any C call, may not reach for minutes. The C-level handler
writes the signal's number into the wakeup file descriptor at once (``signal.set_wakeup_fd``); a
daemon thread reads it, writes the record and ends the process by the same signal with its default
action, so the exit status stays what it was (``-15`` for SIGTERM). A script that installs its own
handler for the signal (the Session's pre-emption handlers, ``SIG_IGN``), or its own wakeup descriptor
(asyncio), keeps it: the witness then stands aside. A forked child (a DataLoader worker) gets the
default actions back.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

# the signals whose default action ends a worker quietly and that a person or a scheduler sends to one
# process (SIGINT raises KeyboardInterrupt, which the worker records with its traceback anyway)
WATCHED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

_lock = threading.Lock()
_on_signal: Callable[[int], None] | None = None


def install(on_signal: Callable[[int], None]) -> bool:
    """Call ``on_signal(signum)`` when a watched signal is about to end this process, then let it end it.

    Only in the main thread, for signals that still have their default action, and when no wakeup
    descriptor is set; returns whether it installed.
    """
    global _on_signal
    if os.name != "posix" or threading.current_thread() is not threading.main_thread() or _on_signal is not None:
        return False
    watched = [sig for sig in WATCHED if signal.getsignal(sig) == signal.SIG_DFL]
    if not watched:
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C handler must never block on a full pipe
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:  # someone else listens there: leave it to them
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return False
    _on_signal = on_signal
    for sig in watched:
        signal.signal(sig, _handler)
    os.register_at_fork(after_in_child=_forget)
    threading.Thread(target=_watch, args=(read_fd,), name="multigpu-signal-witness", daemon=True).start()
    return True


def _forget() -> None:
    """In a forked child (a DataLoader worker): no witness thread runs there, and the wakeup pipe is the
    parent's, whose thread would take the child's signal for its own: give the signals back their defaults."""
    global _on_signal
    if _on_signal is None:
        return
    _on_signal = None
    with contextlib.suppress(ValueError):  # (only a main thread may; after fork the forking thread is one)
        signal.set_wakeup_fd(-1)
        for sig in WATCHED:
            if signal.getsignal(sig) is _handler:
                signal.signal(sig, signal.SIG_DFL)


def _handler(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: reached when the main thread runs bytecode before the thread acts."""
    _die(signum)


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:  # every signal with a Python handler writes here: act only where ours still is
            if signal.getsignal(signum) is _handler:
                _die(signum)


def _die(signum: int) -> None:
    """Record the signal (once), then end the process by it, with its default action, from any thread."""
    with _lock:  # the thread and the main thread's handler may both get here: the first one records
        if _on_signal is not None:
            with contextlib.suppress(Exception):  # a record is a courtesy; the signal must still end the process
                _on_signal(signum)
        _default_action(signum)
        os.kill(os.getpid(), signum)


def _default_action(signum: int) -> None:
    """Put ``signum``'s default action back at the C level (``signal.signal`` works in the main thread only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signum, None)  # SIG_DFL is 0
