"""Pre-emption on the worker's side: SIGTERM or SIGUSR1 becomes a stop that every rank agrees on.

A scheduler about to pre-empt a job sends SIGTERM (SLURM, Kubernetes) or, ahead of time, SIGUSR1
(``sbatch --signal=USR1@120``); ``multigpu launch`` forwards both to every worker. Ending at the
signal loses the work since the last save, and ending each rank where it happens to be leaves the
others blocked in a collective. Instead:

- :class:`StopSignals` installs handlers that only record the signal (a handler runs between two
  bytecodes of the main thread, possibly inside a step: it must not save or communicate);
- :func:`agree` turns the ranks' flags into one answer at a step boundary: one all-reduce (max) of
  one number, so every rank sees True at the same step, including ranks the signal never reached.

:attr:`multigpu.session.Session.should_stop` uses both: the first read installs the handlers (a
loop that reads it has a place to save), each read agrees once.

Example::

    for x, y in session.batches(loader):
        ...
        if session.should_stop:          # every rank reads it, at the same step
            ckpt.save(step=step, model=model, optimizer=optimizer)
            break
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from multigpu.runtime.collectives import reduce_value
from multigpu.runtime.world import in_process_group

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Records SIGTERM / SIGUSR1 instead of dying of them, until :meth:`restore`.

    Only the main thread can install handlers; elsewhere :meth:`install` returns False and the
    signals keep their previous behaviour.
    """

    def __init__(self) -> None:
        self.received: int | None = None  # the first stop signal, once one arrived
        self._previous: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> bool:
        """Handle the stop signals here from now on; returns whether it could (main thread only)."""
        if self._previous:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return True

    def restore(self) -> None:
        """Put the previous handlers back (safe to call twice)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:  # only a flag: no I/O, no collective, inside whatever step is running
            self.received = signum


def agree(local_stop: bool) -> bool:
    """Whether any rank wants to stop: one all-reduce (max) of one flag. Every rank must call it.

    Outside a process group, ``local_stop`` itself.
    """
    if not in_process_group():
        return local_stop
    return bool(reduce_value(1.0 if local_stop else 0.0, "max").item() > 0)  # note: a sync point
