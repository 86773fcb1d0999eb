"""The files a run folder's trackers write themselves (``metrics.csv``, ``hparams.json``, the run record): read back
only when they are what their writer writes.

A run folder is the user's: another program's file may sit at one of these names, or a folder, a named pipe
(appending to one waits for a reader forever) or a link (writing through it changes a file elsewhere). Before a
tracker reads or writes such a file, :func:`check_own_file` refuses anything but a regular file; :func:`read_json`
reads one back bounded and refuses what is not JSON (nested past the parser's recursion included). Each refusal is
a :class:`~multigpu.errors.ConfigError` naming the file and the fix, and leaves the file as it was.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from multigpu.core.run_files import UnreadableFile, read_bytes
from multigpu.errors import ConfigError

JSON_LIMIT = 16 << 20  # bytes: far above any record or hyperparameters a run writes

_KINDS = {
    stat.S_IFLNK: "a link",
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class NotOwnFile(ConfigError):
    """A file that is not what its tracker writes; :attr:`why` says what it is instead."""

    def __init__(self, path: Path, what: str, why: str) -> None:
        super().__init__(
            f"{path} is not {what} ({why}); move it away or delete it, or log to another run folder "
            "(Session(run_dir=...))"
        )
        self.why = why


def refusal(path: Path, what: str, why: str) -> NotOwnFile:
    """The error for ``path`` (``why``: what it is instead of ``what``), with the fix."""
    return NotOwnFile(path, what, why)


def check_own_file(path: Path, what: str) -> bool:
    """Whether ``path`` exists: False when nothing is there, True for a regular file (not a link to one).

    Raises:
        ConfigError: something else is there, named with the fix.
    """
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    except OSError as error:
        raise refusal(path, what, f"not readable ({error.strerror or error})") from None
    if not stat.S_ISREG(mode):
        raise refusal(path, what, _KINDS.get(stat.S_IFMT(mode), "not a regular file"))
    return True


def read_json(path: Path, what: str) -> Any:
    """The JSON document in the regular file ``path`` (at most :data:`JSON_LIMIT` bytes).

    Raises:
        ConfigError: it is not such a file, not UTF-8 or not JSON, named with the fix.
    """
    check_own_file(path, what)
    try:
        return json.loads(read_bytes(path, limit=JSON_LIMIT).decode())
    except UnreadableFile as error:
        raise refusal(path, what, f"unreadable: {error}") from None
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise refusal(path, what, f"not JSON ({str(error)[:120]})") from None
