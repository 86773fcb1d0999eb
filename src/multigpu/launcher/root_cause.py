"""Which worker's failure ended a ddp run: the cause, not the ranks that failed because of it.

When rank 1 raises while rank 0 waits in a collective, rank 0 fails too, a moment later, with a
:class:`~multigpu.errors.PeerExitedError` (or, if rank 1 hangs instead, a
:class:`~multigpu.errors.CollectiveTimeoutError`). torch elastic reports as root cause the failure
with the earliest error-file timestamp, in whole seconds, ties going to the lowest rank, so it
named rank 0's consequence in 9 of 24 runs. Worse, the agent reports only the workers that had
exited when it noticed the first failure: if rank 0's consequence exits first, rank 1's error is
not in its report at all. :func:`merge` adds each worker's own record of its first failure
(:mod:`multigpu.runtime.failure_records`, written before its process group closed), and
:func:`root_cause` picks:

0. a rank a signal stopped before any other rank failed (:func:`signalled_first`: ``kill -TERM`` of its
   pid while the others waited), as its worker recorded the signal's arrival
   (:mod:`multigpu.launcher.signal_witness`); the summary names the signal;
1. among the failures that are not consequences of another rank's, the earliest by the worker's
   record (else the error file's modification time; nanoseconds), so two failures within one
   second keep their order;
2. else the earliest *consequence*: a ``PeerExitedError``, a ``CollectiveTimeoutError``, or a
   backend error that says a peer closed the connection or a collective timed out (a rank hung
   and was stopped, or the cause ran on another node); the summary says it is a consequence;
3. last, the workers the agent itself stopped once another had failed: ended by SIGTERM without
   an error file (torch elastic lists them among the failures too).

:func:`format_summary` then prints the cause's traceback and one line per other failure. With the
workers' :class:`~multigpu.launcher.evidence.Evidence` it says more: when a collective timed out because
a rank never reached it, that rank is named first with its stack (the ranks that timed out are its
consequences); when a worker died by a signal, what gloo or NCCL printed before it died, and the
hint to rerun with ``--debug``; but a rank whose script had returned before a signal ended it (an
abort as the process exited, ``finished``) is reported as that, with no collective to blame.

Example:
    >>> cause = WorkerFailure(rank=1, local_rank=1, exitcode=1, pid=7, message="ValueError: x", traceback="")
    >>> root_cause([cause]).rank
    1
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, replace
from typing import Any

from multigpu.launcher.evidence import GUIDE, Evidence, Hang
from multigpu.runtime.failure_records import Record
from multigpu.runtime.tracking import Entry

# Messages of a rank that failed because another one did (multigpu's explained errors, and the raw
# backend errors of a collective whose peer went away or never came).
_CONSEQUENCE = re.compile(
    r"^(PeerExitedError|CollectiveTimeoutError)\b"
    r"|connection (closed|reset) by peer|broken pipe|timed? ?out waiting|ncclRemoteError|NCCL communicator was aborted",
    re.IGNORECASE | re.MULTILINE,
)


# signals that come from outside the process (kill, a scheduler, the OOM killer), not from its own crash
_SENT_SIGNALS = {"SIGTERM", "SIGKILL", "SIGHUP", "SIGINT", "SIGQUIT"}

_SHOWN_UNREADABLE = 10  # unreadable files named in the summary; the rest are counted

_TIMED_OUT = re.compile(r"timed? ?out waiting", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class WorkerFailure:
    """One failed worker, as the agent saw it.

    Attributes:
        rank: its global rank.
        local_rank: its rank on this node.
        exitcode: its exit code (negative: the signal that ended it); None when the agent stopped it
            while it was exiting with a recorded error.
        pid: its process id (None when the agent did not report it).
        message: ``"Type: message"`` from its error file, or the signal that ended it.
        traceback: its Python traceback (empty when it wrote no error file).
        when_ns: when it failed: the error file's modification time, else the agent's timestamp.
        signal: the signal that ended it, as the worker itself recorded it when it arrived
            (:mod:`multigpu.launcher.signal_witness`); empty when it recorded none.
        finished: its script had returned before it died: it died as the process exited.
    """

    rank: int
    local_rank: int
    exitcode: int | None
    pid: int | None
    message: str
    traceback: str
    when_ns: int = 0
    signal: str = ""
    finished: bool = False

    @property
    def is_consequence(self) -> bool:
        """Whether it failed because another rank did (it lost a peer or timed out waiting for one)."""
        return is_consequence(self.message)

    @property
    def timed_out(self) -> bool:
        """Whether its collective timed out waiting for another rank."""
        return self.message.startswith("CollectiveTimeoutError") or bool(_TIMED_OUT.search(self.message))

    @property
    def stopped_by_launcher(self) -> bool:
        """Ended by SIGTERM without an error: how the agent stops the other workers after a failure."""
        return (self.signal == "SIGTERM" or self.exitcode == -signal.SIGTERM) and not self.traceback

    @property
    def ended_by_signal(self) -> str | None:
        """The signal that ended it without an error (``"SIGTERM"``), if one did."""
        if self.traceback:
            return None
        if self.signal:
            return self.signal
        if self.exitcode is not None and self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return f"signal {-self.exitcode}"
        return None

    @property
    def _tier(self) -> int:
        return 2 if self.stopped_by_launcher else int(self.is_consequence)


def is_consequence(message: str) -> bool:
    """Whether a rank's ``"Type: message"`` says it failed because another rank did (lost a peer, timed out)."""
    return bool(_CONSEQUENCE.search(message))


def from_torch(failures: Mapping[int, Any]) -> list[WorkerFailure]:
    """torch elastic's ``ChildFailedError.failures`` (global rank -> ``ProcessFailure``) as :class:`WorkerFailure`."""
    return [_from_process_failure(rank, failure) for rank, failure in failures.items()]


def _from_process_failure(rank: int, failure: Any) -> WorkerFailure:
    message, traceback = failure.message, ""
    if isinstance(message, dict):  # written by @record: {"message": "Type: text", "extraInfo": {...}}
        traceback = str(message.get("extraInfo", {}).get("py_callstack", ""))
        message = message.get("message", "")
    try:
        when_ns = os.stat(failure.error_file).st_mtime_ns
    except (OSError, TypeError, ValueError):
        when_ns = int(failure.timestamp) * 1_000_000_000
    return WorkerFailure(
        rank=rank,
        local_rank=failure.local_rank,
        exitcode=failure.exitcode,
        pid=failure.pid,
        message=str(message),
        traceback=traceback,
        when_ns=when_ns,
    )


def merge(
    reported: Sequence[WorkerFailure], recorded: Mapping[int, Record], finished: Set[int] = frozenset()
) -> list[WorkerFailure]:
    """The agent's failures completed by the workers' own records of their first failure.

    A recorded error replaces what the agent saw of that rank (a SIGTERM, or its later error file);
    a rank the agent did not report at all (it was stopped while exiting) is added with
    ``exitcode=None``. The ranks in ``finished`` had seen their script return.
    """
    by_rank = {failure.rank: failure for failure in reported}
    for rank, rec in recorded.items():
        seen = by_rank.get(rank)
        by_rank[rank] = WorkerFailure(
            rank=rank,
            local_rank=rec.local_rank,
            exitcode=seen.exitcode if seen else None,
            pid=seen.pid if seen else None,
            message=rec.message,
            traceback=rec.traceback,
            when_ns=rec.when_ns,
            signal=rec.signal,
        )
    done = [replace(f, finished=True) for f in by_rank.values() if f.rank in finished]
    by_rank.update((f.rank, f) for f in done)
    return sorted(by_rank.values(), key=lambda f: f.rank)


def root_cause(failures: Sequence[WorkerFailure]) -> WorkerFailure:
    """The failure that caused the others (see the module docstring). ``failures`` must not be empty."""
    return signalled_first(failures) or min(failures, key=lambda f: (f._tier, f.when_ns, f.rank))


def signalled_first(failures: Sequence[WorkerFailure]) -> WorkerFailure | None:
    """The rank a signal stopped before anything else went wrong, if one did: a signal the launcher did not send.

    The launcher's agent sends its SIGTERM (and, after the grace period, SIGKILL) only once it saw a
    failure, so a signal that ended a rank before any other rank failed in any way came from outside
    (``kill``, a scheduler, the kernel's out-of-memory killer); the ranks that failed after it are its
    consequences. A rank that lost a peer *before* the signal keeps the blame elsewhere (the cause ran
    on another node). A SIGTERM the worker did not record (its script replaced the witness's handler)
    looks like the launcher's own and is not taken for one from outside; a signal death it could not
    record (SIGKILL) has only the agent's whole-second timestamp, so failures in that second count as
    after it.
    """
    signalled = [
        f
        for f in failures
        if f.ended_by_signal in _SENT_SIGNALS and (f.signal or not f.stopped_by_launcher)  # not a crash (SIGABRT)
    ]
    if not signalled:
        return None
    first = min(signalled, key=lambda f: (f.when_ns, f.rank))
    slack = 0 if first.signal else 1_000_000_000
    others = [f for f in failures if f is not first and not f.ended_by_signal]
    return first if all(first.when_ns < f.when_ns + slack for f in others) else None


def format_summary(script: str, failures: Sequence[WorkerFailure], evidence: Evidence | None = None) -> str:
    """The launcher's report: the failing rank and its traceback first, then every other failure in one line.

    With ``evidence`` (what the workers left: :mod:`multigpu.launcher.evidence`), a hang names the rank that
    never arrived and shows its stack, and a worker killed by a signal shows what the backend said.
    """
    unreadable = _unreadable(evidence.unreadable) if evidence is not None else ""
    return _summary(script, failures, evidence) + unreadable


def _summary(script: str, failures: Sequence[WorkerFailure], evidence: Evidence | None) -> str:
    timed_out = [f.rank for f in failures if f.timed_out]
    hang = evidence.hang(timed_out) if evidence is not None else None
    if hang is not None:
        return _hang_summary(script, failures, hang)
    diverged = evidence.diverged(timed_out) if evidence is not None else None
    if diverged is not None:
        return _diverged_summary(script, failures, diverged)
    cause = root_cause(failures)
    if cause.finished and cause.ended_by_signal and not cause.stopped_by_launcher:
        return _died_at_exit_summary(script, failures, cause, evidence)
    stopped_by = cause.ended_by_signal if cause is signalled_first(failures) else None
    said_first = _first_line(cause.message)
    if stopped_by:
        said_first += (
            f": {stopped_by} was not sent by the launcher (a signal to this rank alone: kill, a scheduler, the "
            "kernel's out-of-memory killer); the other ranks failed because it left"
        )
    head = (
        f"multigpu launch: {script} failed on rank {cause.rank} (local_rank {cause.local_rank}, "
        f"{_ending(cause)}): {said_first}"
    )
    if not stopped_by and (cause.is_consequence or cause.stopped_by_launcher):
        head += (
            "\n  (this rank lost a peer or timed out waiting for one: the cause is a rank that hung, was killed "
            "without an error, or ran on another node; look at that node's launcher)"
        )
    lines = [head]
    said = evidence.abort_text(cause.rank, cause.local_rank) if evidence is not None and not cause.traceback else []
    if said:
        lines += ["  it printed before it died:", *(f"    {line}" for line in said)]
        lines.append(
            "  a collective the ranks issued differently (another operation, shape or dtype) aborts like this: "
            "rerun with 'multigpu launch --debug' (or Session(debug=True)) to name each rank's collective, "
            f"shape and line; see {GUIDE}"
        )
    if cause.traceback:
        lines += ["", f"Traceback of rank {cause.rank}:", cause.traceback.rstrip()]
    return "\n".join(lines + _others(failures, cause))


def _died_at_exit_summary(
    script: str, failures: Sequence[WorkerFailure], cause: WorkerFailure, evidence: Evidence | None
) -> str:
    """A rank whose script had returned, then died of a signal as its process exited (no collective was running)."""
    lines = [
        f"multigpu launch: {script} finished on rank {cause.rank} (local_rank {cause.local_rank}), then the "
        f"process died as it exited ({_ending(cause)}, {cause.ended_by_signal}): it aborted at exit, after its "
        "script returned, so its training and its output are complete; a library's thread was still running "
        f"as the interpreter shut down (see {GUIDE}, section 'A rank that aborts at exit')"
    ]
    said = evidence.abort_text(cause.rank, cause.local_rank) if evidence is not None else []
    if said:
        lines += ["  it printed before it died:", *(f"    {line}" for line in said)]
    return "\n".join(lines + _others(failures, cause))


def _others(failures: Sequence[WorkerFailure], cause: WorkerFailure) -> list[str]:
    others = sorted((f for f in failures if f is not cause), key=lambda f: f.rank)
    if not others:
        return []
    lines = ["", "Other ranks that failed (consequences or later errors):"]
    return lines + [f"  rank {f.rank} (local_rank {f.local_rank}, {_ending(f)}): {_outcome(f)}" for f in others]


def _hang_summary(script: str, failures: Sequence[WorkerFailure], hang: Hang) -> str:
    """A hang's report: who never arrived and where (first), then the ranks that timed out, then the rest."""
    timed_out = [f for f in failures if f.timed_out and f.rank not in hang.missing]
    first_ns = min((f.when_ns for f in timed_out), default=0)
    lines = [hang.lead(script, first_ns), *hang.details()]
    if timed_out:
        lines += ["", "Ranks that timed out waiting for it (consequences):"]
        lines += [
            f"  rank {f.rank} (local_rank {f.local_rank}, {_ending(f)}): {_first_line(f.message)}" for f in timed_out
        ]
    rest = [f for f in failures if f not in timed_out and f.rank not in hang.missing]
    if rest:
        lines += ["", "Other ranks that failed:"]
        lines += [f"  rank {f.rank} (local_rank {f.local_rank}, {_ending(f)}): {_outcome(f)}" for f in rest]
    lines += ["", f"Why a run hangs and what to do: {GUIDE}"]
    return "\n".join(lines)


def _diverged_summary(script: str, failures: Sequence[WorkerFailure], entries: dict[int, Entry]) -> str:
    """Ranks that waited in the same collective number but different operations: the calls, side by side."""
    seq = next(iter(entries.values())).seq
    calls = "; ".join(f"rank {r}: {e.operation}" + (f" at {e.site}" if e.site else "") for r, e in entries.items())
    lines = [
        f"multigpu launch: {script} hung: the ranks waited in different collectives at #{seq} ({calls}) until "
        "the collective timeout: a collective issued in a different order, or on some ranks only",
        "  rerun with 'multigpu launch --debug' (or Session(debug=True)) to stop at the first differing call "
        f"on every rank; see {GUIDE}",
        "",
        "Ranks that failed:",
    ]
    lines += [f"  rank {f.rank} (local_rank {f.local_rank}, {_ending(f)}): {_outcome(f)}" for f in failures]
    return "\n".join(lines)


def _unreadable(files: Sequence[str]) -> str:
    """The summary's last lines: the run's files it left out because they are not what a worker writes."""
    if not files:
        return ""
    lines = ["", "Unreadable records left out of this summary (not what a worker writes; the summary may miss a rank):"]
    lines += [f"  {line}" for line in files[:_SHOWN_UNREADABLE]]
    if len(files) > _SHOWN_UNREADABLE:
        lines.append(f"  ... and {len(files) - _SHOWN_UNREADABLE} more")
    return "\n".join(lines)


def _ending(failure: WorkerFailure) -> str:
    if failure.exitcode is None:
        return "stopped by the launcher as it exited"
    return f"exit code {failure.exitcode}"


def _outcome(failure: WorkerFailure) -> str:
    said = _first_line(failure.message)
    return f"{said} (stopped by the launcher)" if failure.stopped_by_launcher else said


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no error message (see the worker's output above)"
