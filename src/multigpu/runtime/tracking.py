"""Each rank's record of the collectives it entered, the debug fingerprint check, and its stack on request.

Three things a launcher needs to say *which* rank stopped a run, *where* and *why*, kept by the worker:

- **The ledger.** Every collective multigpu issues passes :func:`enter` (through
  :func:`multigpu.runtime.collectives.issuing`): it counts the collective (a sequence number, the same on
  every rank while they agree), names it ("reduce (mean)") and its call site in the user's script
  (``train.py:41``), and notes the time. Under ``multigpu launch`` the entry is written into a small
  memory-mapped file in the run's failure folder (no system call per collective), which the launcher reads
  after a failure to compare ranks: a rank whose count is behind the others' never arrived.
- **The stack on request.** :func:`setup_worker` (run by the worker entry point, :func:`setup_worker`) registers
  :mod:`faulthandler` on :data:`STACK_SIGNAL` to write every thread's Python stack into the failure folder.
  faulthandler writes from the C signal handler, so the stack comes whether the rank sleeps, spins in a
  Python loop or is blocked in native code. A rank whose collective timed out calls
  :func:`request_peer_stacks` before it fails: the other ranks of this node dump their stacks while they
  are still alive, before the launcher stops them.
- **The fingerprint check** (``multigpu launch --debug`` / ``Session(debug=True)``). Before each
  collective, every rank exchanges what it is about to do (operation, shapes, dtypes, call site); on a
  difference every rank raises :class:`~multigpu.errors.CollectiveMismatchError` naming each rank's call,
  instead of gloo aborting or NCCL hanging.

The file forms are written once, here, for both sides (the launcher reads them with :func:`read_ledgers`
and :func:`read_stack`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import mmap
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from multigpu.core.run_files import (
    UnreadableFile,
    entries,
    field,
    modified_ns,
    open_appending,
    parse_json,
    read_bytes,
    read_json,
    write_replacing,
)
from multigpu.errors import CollectiveMismatchError
from multigpu.runtime import peers, world

# The signal that asks a worker for its stacks: a real-time signal nobody else uses (SIGUSR1/2 are
# taken by schedulers for requeue and by user code); SIGUSR2 where real-time signals do not exist.
STACK_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2

_LEDGER_BYTES = 1024  # one entry: a JSON object padded with spaces
_SNAPSHOT_BYTES = 4 * _LEDGER_BYTES * 1024  # every rank of a node's ledger entry, for up to 1024 ranks
_STACK_BYTES = 1 << 20  # the end of a stack file (the newest dumps; each is a few KiB per thread)
_BLANK = b" " * (_LEDGER_BYTES - 1) + b"\n"
_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # .../multigpu/
_SKIPPED = (_PACKAGE, str(Path(torch.__file__).resolve().parent) + os.sep, contextlib.__file__)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """The last collective a rank entered.

    Attributes:
        rank: its global rank.
        pid: its process id (on the node whose failure folder holds the entry).
        main_thread: the id of its main thread (to find that thread in a stack dump).
        seq: how many collectives it had entered (1 = the first); 0: none yet.
        operation: what the collective does ("reduce (mean)", "barrier"), "" before the first.
        site: where the user's script called it (``train.py:41``), "" when unknown.
        since: when it entered it (seconds since the epoch).
        start: when its process started (clock ticks after boot, :func:`multigpu.runtime.peers.start_time`;
            0 when unknown): what proves a live pid is still this rank's (:mod:`multigpu.runtime.peers`).
    """

    rank: int
    pid: int
    main_thread: int
    seq: int
    operation: str
    site: str
    since: float
    start: int = 0


class _Ledger:
    """This process's count of collectives and, under a launcher, its memory-mapped file."""

    def __init__(self) -> None:
        self.seq = 0
        self.debug = world.debug_requested()
        self._map: mmap.mmap | None = None
        self._prefix = ""
        self._opened = False

    def write(self, operation: str, site: str) -> None:
        if not self._opened:
            self._open()
        if self._map is None:
            return
        # bounded, so an entry always fits the ledger whole (a cut entry would be unreadable)
        operation, site = json.dumps(operation[:200]), json.dumps(site[:300])
        self._store(f'{self._prefix}"seq": {self.seq}, "operation": {operation}, "site": {site}, ')

    def _store(self, text: str) -> None:
        assert self._map is not None
        data = f'{text}"since": {time.time()}}}'.encode()[: _LEDGER_BYTES - 1]
        self._map[:] = data + _BLANK[len(data) :]  # one memory copy, no system call

    def _open(self) -> None:
        self._opened = True
        path = _ledger_path()
        if path is None:
            return
        with contextlib.suppress(OSError):  # a ledger is a courtesy to the summary; never fail the worker
            # a regular file of its own only: never through a link planted there (it would truncate the target)
            flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(path, flags, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return
                os.ftruncate(fd, 0)
                os.write(fd, _BLANK)
                self._map = mmap.mmap(fd, _LEDGER_BYTES)
            finally:
                os.close(fd)
            base = {
                "rank": world.global_rank(),
                "pid": os.getpid(),
                "start": peers.start_time(),
                "main_thread": threading.main_thread().ident,
            }
            self._prefix = json.dumps(base)[:-1] + ", "  # the fixed part of every entry, written once
            # entry #0: the rank is known (and can be asked for its stack) before its first collective
            self._store(f'{self._prefix}"seq": 0, ')


_ledger = _Ledger()
_stack_file: IO[str] | None = None  # kept open: faulthandler writes into its descriptor


def enable_debug() -> None:
    """Turn on the fingerprint check for this process and torch's own (:func:`multigpu.runtime.world.enable_torch_debug`).

    Call it before the process group is created (``Session(debug=True)`` does). Every rank must call it.
    """
    _ledger.debug = True
    world.enable_torch_debug()


def debug_enabled() -> bool:
    """Whether collectives exchange fingerprints first (``--debug`` / ``Session(debug=True)``)."""
    return _ledger.debug


def enter(operation: str, tensors: Sequence[torch.Tensor] = (), *, ragged: bool = False) -> None:
    """Note that this rank enters a collective; under debug, check every rank enters the same one.

    Args:
        operation: what the collective does, e.g. ``"reduce (mean)"``.
        tensors: the tensors it communicates (their shapes and dtypes are compared under debug).
        ragged: the first dimension may differ between ranks (a gather of uneven shards).

    Raises:
        CollectiveMismatchError: under debug, the ranks are about to issue different collectives.
    """
    _ledger.seq += 1
    site = call_site()
    _ledger.write(operation, site)
    if _ledger.debug and world.in_process_group():
        _check_fingerprints(operation, tensors, ragged, site)


def call_site() -> str:
    """``file:line`` of the innermost frame outside multigpu and torch (the user's call), else ""."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return ""
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def _check_fingerprints(operation: str, tensors: Sequence[torch.Tensor], ragged: bool, site: str) -> None:
    import torch.distributed as dist

    shapes = [("*", *t.shape[1:]) if ragged and t.dim() else tuple(t.shape) for t in tensors]
    mine = (operation, [(shape, str(t.dtype).removeprefix("torch.")) for shape, t in zip(shapes, tensors)], site)
    everyone: list[Any] = [None] * world.world_size()
    dist.all_gather_object(everyone, mine)  # note: a sync point; the extra collective --debug pays for
    if all(other[:2] == mine[:2] for other in everyone):
        return
    lines = [f"  rank {rank}: {describe(*call)}" for rank, call in enumerate(everyone)]
    raise CollectiveMismatchError(
        f"the ranks issued different collectives at collective #{_ledger.seq} (found by the --debug check):\n"
        + "\n".join(lines)
        + "\nFix: every rank must call the same collectives in the same order with tensors of the same shape "
        "and dtype (look for a collective inside 'if rank == 0', or a tensor whose size depends on the rank)."
    )


def describe(operation: str, tensors: Sequence[tuple[tuple[Any, ...], str]], site: str) -> str:
    """One rank's call in words: ``reduce (mean) shape (3,) float64 at train.py:41``.

    Example:
        >>> describe("reduce (mean)", [((3,), "float64")], "train.py:41")
        'reduce (mean) shape (3,) float64 at train.py:41'
    """
    shapes = ", ".join(f"shape {_shape(shape)} {dtype}" for shape, dtype in tensors)
    return " ".join(part for part in (operation, shapes, f"at {site}" if site else "") if part)


def _shape(shape: tuple[Any, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


# -- stacks on request ------------------------------------------------------------------------------


def setup_worker() -> None:
    """Prepare a launched worker: its stacks on :data:`STACK_SIGNAL`, its ledger file, ``--debug``'s checks.

    Run by :mod:`multigpu.launcher._entry` before the script starts. The stacks go into the failure
    folder; the ledger file (which holds this process's id) is created after the handler, so a peer only
    ever signals a process that is ready for the signal. A no-op outside ``multigpu launch``.
    """
    global _stack_file
    if _ledger.debug:  # before the script creates its process group
        world.enable_torch_debug()
    path = _stack_path(world.global_rank())
    if path is None or _stack_file is not None:
        return
    try:  # a regular file only: a FIFO planted there would block this worker's start
        _stack_file = os.fdopen(open_appending(path), "a")  # kept open for the process's life
    except OSError:
        return
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    _ledger._open()


def request_peer_stacks(*, wait_s: float = 3.0) -> None:
    """Ask every other rank of this node for its stacks, and wait (up to ``wait_s``) until they are written.

    Called by a rank whose collective timed out, before it fails, so the stacks show where the other
    ranks are while they still run. Adds no communication; a no-op outside ``multigpu launch``.
    """
    folder, me = world.failure_dir(), world.global_rank()
    if folder is None:
        return
    pending: dict[Path, int] = {}
    ledgers = read_ledgers(folder, attempt=world.restart_count())
    _write_snapshot(Path(folder), me, ledgers)
    for entry in ledgers.values():
        if entry.rank == me:
            continue
        stack = _stack_path(entry.rank)
        size = _size(stack) if stack is not None else 0
        # only a process that proves to be this rank's worker of this run: a ledger may name anyone's pid
        if not peers.signal_peer(entry.pid, STACK_SIGNAL, rank=entry.rank, start=entry.start, run_dir=folder):
            continue
        if stack is not None:
            pending[stack] = size
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = {p: s for p, s in pending.items() if _size(p) <= s}


def read_ledgers(folder: str | Path, *, attempt: int, skipped: list[str] | None = None) -> dict[int, Entry]:
    """Every rank's last entered collective recorded in ``folder`` for ``attempt``, by rank.

    A file that is not a ledger as a worker writes it is left out, in bounded time; ``skipped`` gets
    ``"path: why"`` for each.
    """
    found: dict[int, Entry] = {}
    for path in entries(folder, f"attempt-{attempt}-rank-*.ledger"):
        try:
            entry = _entry(_read_entry(path))
        except UnreadableFile as exc:
            if skipped is not None:
                skipped.append(f"{path}: {exc}")
            continue
        found[entry.rank] = entry
    return found


def _read_entry(path: Path, tries: int = 3) -> Any:
    """The ledger's JSON; read again when caught while its rank rewrites it (one memory copy, not atomic)."""
    for _ in range(tries - 1):
        with contextlib.suppress(UnreadableFile):
            return _parse_entry(read_bytes(path, limit=_LEDGER_BYTES))
        time.sleep(0.01)
    return _parse_entry(read_bytes(path, limit=_LEDGER_BYTES))


def _parse_entry(data: bytes) -> Any:
    return parse_json(data.strip() or b"{}")


def _entry(data: Any) -> Entry:
    """A ledger entry from its JSON, every field of its type and in range (raises :class:`UnreadableFile`)."""
    entry = Entry(
        rank=field(data, "rank", int),
        pid=field(data, "pid", int),
        main_thread=field(data, "main_thread", int),
        seq=field(data, "seq", int, 0),
        operation=field(data, "operation", str, ""),
        site=field(data, "site", str, ""),
        since=field(data, "since", float, 0.0),
        start=field(data, "start", int, 0),
    )
    if entry.rank < 0 or not 1 < entry.pid < 2**31 or entry.seq < 0 or entry.start < 0:
        raise UnreadableFile(f"its rank {entry.rank}, pid {entry.pid} or count {entry.seq} is not one a worker has")
    if not 0 <= entry.since < 1e11:  # seconds since the epoch: a time.localtime() must take it
        raise UnreadableFile(f"its time {entry.since} is not a time a worker wrote")
    return entry


def read_snapshot(folder: str | Path, *, attempt: int, skipped: list[str] | None = None) -> dict[int, Entry]:
    """Every rank's ledger as the first rank that timed out saw it at that moment ({} when none did).

    The moment that matters: a rank woken afterwards (a signal ending its native wait, the others exiting)
    may enter more collectives before the launcher reads the ledgers. An unreadable snapshot is left out
    (``skipped`` gets ``"path: why"``) and the next one is read.
    """
    snapshots = sorted(entries(folder, f"attempt-{attempt}-snapshot-by-rank-*.json"), key=modified_ns)
    for path in snapshots:
        try:
            data = read_json(path, limit=_SNAPSHOT_BYTES)
            if not isinstance(data, dict):
                raise UnreadableFile(f"it holds a {type(data).__name__} where its writer writes a mapping")
            found = {rank: _entry(entry) for rank, entry in data.items()}
            if any(str(entry.rank) != rank for rank, entry in found.items()):
                raise UnreadableFile("its ranks do not match their entries")
            return {entry.rank: entry for entry in found.values()}
        except UnreadableFile as exc:
            if skipped is not None:
                skipped.append(f"{path}: {exc}")
    return {}


def _write_snapshot(folder: Path, me: int, ledgers: dict[int, Entry]) -> None:
    path = folder / f"attempt-{world.restart_count()}-snapshot-by-rank-{me}.json"
    with contextlib.suppress(OSError):
        write_replacing(path, json.dumps({rank: entry.__dict__ for rank, entry in ledgers.items()}))


def read_stack(folder: str | Path, *, attempt: int, rank: int, skipped: list[str] | None = None) -> str:
    """The stack dumps ``rank`` wrote into ``folder`` (faulthandler's text, one block per thread), or "".

    Only the end of the file (the newest dumps) is read; a file that is not a regular file is left out
    (``skipped`` gets ``"path: why"``).
    """
    path = Path(folder) / f"attempt-{attempt}-rank-{rank}.stacks"
    try:
        return read_bytes(path, limit=_STACK_BYTES, tail=True).decode(errors="replace")
    except UnreadableFile as exc:
        if skipped is not None and os.path.lexists(path):
            skipped.append(f"{path}: {exc}")
        return ""


def stderr_copy_path(folder: str | Path, *, attempt: int, rank: int) -> Path:
    """Where a worker copies its stderr for the launcher's summary (what gloo or NCCL print before an abort)."""
    return Path(folder) / f"attempt-{attempt}-rank-{rank}.stderr"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _ledger_path() -> Path | None:
    folder = world.failure_dir()
    if folder is None:
        return None
    return Path(folder) / f"attempt-{world.restart_count()}-rank-{world.global_rank()}.ledger"


def _stack_path(rank: int) -> Path | None:
    folder = world.failure_dir()
    if folder is None:
        return None
    return Path(folder) / f"attempt-{world.restart_count()}-rank-{rank}.stacks"
