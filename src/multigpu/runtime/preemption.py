"""Pre-emption on the worker's side: SIGTERM or SIGUSR1 becomes a stop that every rank agrees on.

A scheduler about to pre-empt a job sends SIGTERM (SLURM, Kubernetes) or, ahead of time, SIGUSR1
(``sbatch --signal=USR1@120``); ``multigpu launch`` forwards both to every worker. Ending at the
signal loses the work since the last save, and ending each rank where it happens to be leaves the
others blocked in a collective. Instead:

- :class:`StopSignals` installs handlers that only record the signal (a handler runs between two
  bytecodes of the main thread, possibly inside a step: it must not save or communicate);
- :class:`StopAgreement` turns the ranks' flags into one answer at a step boundary: an all-reduce
  (max) of one number, started asynchronously at one read and collected at the next, so it rides
  alongside the next step's work instead of adding a sync point; every rank sees True at the same
  step (one step after the signal), including ranks the signal never reached. :func:`agree` is the
  blocking form.

:attr:`multigpu.session.Session.should_stop` uses both: the first read installs the handlers (a
loop that reads it has a place to save), each read polls the agreement once.

Example::

    for x, y in session.batches(loader):
        ...
        if session.should_stop:          # every rank reads it, at the same step
            ckpt.save(step=step, model=model, optimizer=optimizer)
            break
"""

from __future__ import annotations

import contextlib
import signal
import threading
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from multigpu.errors import CollectiveMismatchError
from multigpu.runtime.collectives import reduce_value
from multigpu.runtime.world import global_rank, in_process_group

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_received: int | None = None  # the first stop signal any StopSignals of this process recorded


def stop_signal_received() -> int | None:
    """The first stop signal a :class:`StopSignals` recorded in this process (None while none came).

    The worker's entry point asks it under ``--fault-tolerant``, where a group that left its loop at a
    signal has not finished the run (:mod:`multigpu.launcher._entry`).
    """
    return _received


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
        global _received
        if self.received is None:  # only a flag: no I/O, no collective, inside whatever step is running
            self.received = signum
        if _received is None:
            _received = signum


def agree(local_stop: bool) -> bool:
    """Whether any rank wants to stop, now: one blocking all-reduce (max) of one flag. Every rank must call it.

    Outside a process group, ``local_stop`` itself.
    """
    if not in_process_group():
        return local_stop
    return bool(reduce_value(1.0 if local_stop else 0.0, "max", what="the stop flag").item() > 0)  # note: a sync point


class StopAgreement:
    """The ranks' stop flags agreed one step late, so the agreement adds no sync point to a step.

    Each :meth:`poll` starts an asynchronous all-reduce (max) of this rank's flag and returns the
    result of the one the previous poll started, which has had a whole step to complete (it runs on
    the backend's own threads while the step computes). Every rank sees True at the same poll;
    the stop comes one step after the signal. Every rank must poll the same number of times and
    call :meth:`finish` before the process group closes.
    """

    def __init__(self) -> None:
        self._pending: tuple[torch.Tensor, Any] | None = None
        self._group: Any = None  # gloo: the default group; else a gloo side group, made at the first poll

    def poll(self, local_stop: bool) -> bool:
        """The previous poll's agreement (False at the first), after starting this one's."""
        if not in_process_group():
            return local_stop
        agreed = self.finish()
        if self._group is None:
            # On the CPU over gloo even when the run uses NCCL: a flag on the GPU would queue behind
            # the step's kernels, and reading it would wait for them (a device sync every step).
            # new_group is itself a collective: every rank reaches its first poll at the same point.
            default = dist.group.WORLD
            self._group = default if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        flag = torch.tensor([1.0 if local_stop else 0.0])
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True))
        return agreed

    def settle(self, timeout_s: float = 10.0) -> None:
        """Before the process group closes: let the agreement in flight complete, without hanging on a
        rank that is gone (after a failure the group is being torn down anyway)."""
        if self._pending is None:
            return
        _, work = self._pending
        self._pending = None
        with contextlib.suppress(Exception):
            work.wait(timedelta(seconds=timeout_s))

    def finish(self) -> bool:
        """Wait for the agreement in flight, if any; whether it said stop."""
        if self._pending is None:
            return False
        flag, work = self._pending
        self._pending = None
        work.wait()  # note: done long ago in a training loop; a sync point otherwise
        value = flag.item()
        if value not in (0.0, 1.0):  # a max of 0/1 flags: anything else came from another collective
            raise CollectiveMismatchError(
                f"the stop flag's all-reduce on rank {global_rank()} came back as {value!r}, not 0 or 1: another "
                "rank issued a different collective at that point. Fix: every rank must read session.should_stop "
                "(or take a session.batches step) the same number of times"
            )
        return bool(value > 0)
