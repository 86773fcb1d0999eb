"""One writer at a time per checkpoint folder: an advisory lock that says who holds it.

Two processes saving into one folder (two runs pointed at the same place, a restarted job whose
old copy still runs) would otherwise race on the same names. Each save takes an exclusive
``flock`` on ``<folder>/.multigpu.lock``, writes its host, pid and start time into it, and waits
up to a timeout for another holder; a holder that dies releases the lock with its file
descriptors, so a SIGKILL never leaves the folder locked. ``flock`` is per host on most network
file systems: do not share one folder between machines.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from multigpu.errors import CheckpointError

LOCK_NAME = ".multigpu.lock"
_POLL_S = 0.02


@contextlib.contextmanager
def folder_lock(folder: Path, *, timeout_s: float) -> Iterator[None]:
    """Hold the folder's lock for the duration of the block.

    Raises:
        CheckpointError: another process held it for ``timeout_s`` seconds; the message names it.

    Example:
        >>> import tempfile
        >>> with folder_lock(Path(tempfile.mkdtemp()), timeout_s=1):
        ...     pass
    """
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _acquire(fd, path, timeout_s)
        holder = f"host={socket.gethostname()} pid={os.getpid()} since={time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(fd: int, path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"another process is saving into {str(path.parent)!r} and held its lock for "
                    f"{timeout_s:g} s ({_holder(path)}). Two runs are writing one folder: give each "
                    "run its own folder, or raise Checkpointer(lock_timeout_s=...) if saves are slow."
                ) from None
            time.sleep(_POLL_S)


def _holder(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            text = f.read(200).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"
