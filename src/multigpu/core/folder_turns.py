"""Writers of one folder's read-modify-write file taking turns on the kernel's ``flock`` on the folder itself.

Two writers that each read a file, add theirs and rename their copy over it lose one's update when a rename
falls between the other's read and rename. Holding the folder's flock from the read to the rename makes them
take turns: ``hparams.json`` in a run folder (:mod:`multigpu.session.trackers.csv_file`), the planner's machine
cache (:func:`multigpu.planning.machine.record_feedback`), the peak FLOP/s cache
(:mod:`multigpu.devices.peak_flops`). No lock file is left behind, and the kernel drops the
lock however its holder exits (a SIGKILL included). Where the folder takes no flock (NFS maps it to a POSIX
lock that a read-only descriptor cannot take exclusively) or cannot be opened, the block runs without turns
(the write that follows says what is wrong with the folder).

Example:
    >>> import tempfile
    >>> with taking_turns(Path(tempfile.mkdtemp()), hold_s=1.0, held_too_long=TimeoutError) as held:
    ...     held
    True
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

_POLL_S = 0.005  # between tries: a turn lasts milliseconds


@contextlib.contextmanager
def taking_turns(folder: Path, *, hold_s: float, held_too_long: Callable[[str], BaseException]) -> Iterator[bool]:
    """Hold ``folder``'s flock for the block, waiting up to ``hold_s`` seconds for another holder; yields whether
    it is held (False where the folder takes no flock or cannot be opened): then no other writer is inside its
    turn, so a partial file a writer left is one killed inside its turn (:func:`multigpu.core.run_files.remove_partials`).

    Raises:
        What ``held_too_long(message)`` returns: another holder kept it ``hold_s`` seconds (a stopped process).
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        fd = -1  # the write that follows says what is wrong with the folder
    try:
        deadline = time.monotonic() + hold_s
        held = _tried(fd) if fd >= 0 else None
        while held is False:
            if time.monotonic() > deadline:
                raise held_too_long(f"another process kept {folder} locked for {hold_s:g} s")
            time.sleep(_POLL_S)
            held = _tried(fd)
        yield bool(held)
    finally:
        if fd >= 0:
            os.close(fd)  # releases the lock


def _tried(fd: int) -> bool | None:
    """Take the lock: True, held now; False, another holds it; None, no flock here (go on unlocked)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True
