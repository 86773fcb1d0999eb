"""Each worker's first failure, written where the launcher can read it even if the agent could not.

torch elastic's agent collects the workers that have exited when it notices the first failure and
stops the rest with SIGTERM. When rank 1 raises while rank 0 waits in a collective, closing rank
1's process group wakes rank 0 with a :class:`~multigpu.errors.PeerExitedError`; if rank 0 exits
first (both are tearing down; load decides the order), the agent never sees rank 1's error: it
reports only rank 0's consequence, and rank 1 is stopped as it exits. So each worker records its
first failure itself, *before* its process group closes, into a folder the launcher creates for the
run (``MULTIGPU_FAILURE_DIR``): one JSON file per rank and attempt, written atomically. The
launcher merges these records with the agent's report (:mod:`multigpu.launcher.root_cause`).

The file's form is written once, here, for both sides: the worker's :func:`record` and the
launcher's :func:`read` (the launcher imports the runtime; nothing here imports the launcher).

Example::

    record(ValueError("broke"))     # in a worker; a no-op when not under multigpu launch
    read(folder, attempt=0)         # in the launcher: {rank: Record}
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from multigpu.core.run_files import UnreadableFile, entries, field, read_json, write_replacing
from multigpu.runtime import world

# what a record may hold: the writer cuts to these, the reader refuses a file larger than the whole
_MESSAGE_CHARS = 64_000
_TRACEBACK_CHARS = 1_000_000  # its end: the innermost frames and the error
RECORD_BYTES = 8 * (_MESSAGE_CHARS + _TRACEBACK_CHARS)  # JSON escapes may take six bytes a character


@dataclass(frozen=True, kw_only=True)
class Record:
    """One worker's first failure.

    Attributes:
        rank: its global rank.
        local_rank: its rank on its node.
        message: ``"Type: message"``.
        traceback: the formatted Python traceback.
        when_ns: when it was recorded (``time.time_ns()``), before its process group closed.
        signal: the signal that ended it (``"SIGTERM"``), when a signal did and not an exception.
    """

    rank: int
    local_rank: int
    message: str
    traceback: str
    when_ns: int
    signal: str = ""


def record(exc: BaseException) -> None:
    """Record ``exc`` as this worker's failure (only the first one counts; no-op outside ``multigpu launch``).

    Call it before the process group closes: every rank may call it; it adds no communication.
    """
    _write(
        message=f"{type(exc).__name__}: {exc}",
        trace="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


def record_signal(signum: int) -> None:
    """Record that signal ``signum`` is ending this worker, and when (only the first failure counts).

    Called from :mod:`multigpu.launcher.signal_witness` as the signal arrives, wherever the main
    thread is; adds no communication; a no-op outside ``multigpu launch``.
    """
    name = signal.Signals(signum).name
    _write(message=f"stopped by {name}", trace="", signal_name=name)


def record_finished() -> None:
    """Mark that this worker's script has returned (or called ``sys.exit(0)``): what follows is the process's exit.

    Called by :mod:`multigpu.launcher._entry`; a no-op outside ``multigpu launch``. A rank that dies after
    it (a C++ library's abort as the interpreter exits) is then reported as dying at exit, its work done,
    rather than as a failure during training.
    """
    folder, env = world.failure_dir(), world.read_launch_env()
    if folder is None or env is None:
        return
    with contextlib.suppress(OSError):  # never through a pipe or a link left at its name (write_replacing)
        write_replacing(_finished_path(folder, world.restart_count(), env.global_rank), str(time.time_ns()))


def read_finished(folder: str | Path, *, attempt: int) -> set[int]:
    """The global ranks of ``attempt`` whose script had returned (:func:`record_finished`)."""
    found = set()
    for path in entries(folder, f"attempt-{attempt}-rank-*.finished"):  # the names alone: no content is read
        with contextlib.suppress(ValueError):  # a name whose rank is not a number is not one record_finished wrote
            found.add(int(path.name.removesuffix(".finished").rsplit("-", 1)[1]))
    return found


def _finished_path(folder: str | Path, attempt: int, rank: int) -> Path:
    return Path(folder) / f"attempt-{attempt}-rank-{rank}.finished"


def _write(*, message: str, trace: str, signal_name: str = "") -> None:
    folder, env = world.failure_dir(), world.read_launch_env()
    if folder is None or env is None:
        return
    path = Path(folder) / f"attempt-{world.restart_count()}-rank-{env.global_rank}.json"
    if path.exists():  # an earlier failure of this attempt is the cause; later ones are its echo
        return
    data = {
        "rank": env.global_rank,
        "local_rank": env.local_rank,
        "message": message[:_MESSAGE_CHARS],
        "traceback": trace[-_TRACEBACK_CHARS:],
        "when_ns": time.time_ns(),
        "signal": signal_name,
    }
    with contextlib.suppress(OSError):  # a record is a courtesy to the summary; never fail the worker over it
        write_replacing(path, json.dumps(data))


def read(folder: str | Path, *, attempt: int, skipped: list[str] | None = None) -> dict[int, Record]:
    """The records of ``attempt`` in ``folder``, by global rank.

    A file that is not a record as :func:`record` writes it (cut short, garbage, a pipe, a link to a
    device, too large) is left out, in bounded time; ``skipped`` gets ``"path: why"`` for each, for the
    summary to name.
    """
    found: dict[int, Record] = {}
    for path in entries(folder, f"attempt-{attempt}-rank-*.json"):
        try:
            data = read_json(path, limit=RECORD_BYTES)
            rank = field(data, "rank", int)
            if rank < 0:
                raise UnreadableFile(f"its rank is {rank}")
            found[rank] = Record(
                rank=rank,
                local_rank=field(data, "local_rank", int),
                message=field(data, "message", str),
                traceback=field(data, "traceback", str),
                when_ns=field(data, "when_ns", int),
                signal=field(data, "signal", str, ""),
            )
        except UnreadableFile as exc:
            if skipped is not None:
                skipped.append(f"{path}: {exc}")
    return found
