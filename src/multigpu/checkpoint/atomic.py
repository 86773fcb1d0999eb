"""Atomic writes: a file or a folder appears under its final name complete, or not at all.

The recipe (POSIX): write into a temporary name in the *same* folder (so the rename never crosses
file systems), flush and ``fsync`` the data, ``os.replace`` it onto the final name (atomic), then
``fsync`` the folder so the rename itself survives a power cut. A process killed at any point
leaves either the previous file or the new one under the final name; at worst a temporary entry
remains, and temporary names start with ``.`` and contain ``.tmp-`` so nothing that looks for
checkpoints picks them up (``remove_stale_temporaries`` deletes them).

Errors while writing (full disk, file-size limit, read-only or unwritable folder) become a
:class:`~multigpu.errors.CheckpointError` naming the path and the fix; the temporary entry is
removed and the previous file is untouched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from multigpu.errors import CheckpointError

TEMP_MARKER = ".tmp-"

_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_PERMISSION_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}


def temporary_name(final: Path) -> Path:
    """A unique hidden sibling of ``final`` that checkpoint discovery ignores.

    The name holds the host and process id so a later run can tell whose leftover it is.
    """
    host = socket.gethostname().replace(".", "_")
    return final.with_name(f".{final.name}{TEMP_MARKER}{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is a temporary or discarded entry written by this module."""
    return path.name.startswith(".") and TEMP_MARKER in path.name


def fsync_folder(folder: Path) -> None:
    """Make the entries of ``folder`` (renames, new files) durable."""
    _fsync_path(folder)


def fsync_file(path: Path) -> None:
    """Flush the data of a file that something else (e.g. a Rust writer) has written and closed."""
    _fsync_path(path)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_file(final: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> Path:
    """Write a file through ``write(fileobj)`` so that ``final`` is either the old or the new file.

    Args:
        final: where the file should end up; its folder must exist.
        write: called with a binary file object open on the temporary file.

    Returns:
        The final path.

    Raises:
        CheckpointError: the disk is full, a size limit was hit, or the folder is not writable;
            the previous file under ``final`` is unchanged.

    Example:
        >>> import tempfile
        >>> p = atomic_write_file(Path(tempfile.mkdtemp()) / "x.bin", lambda f: f.write(b"hi"))
        >>> p.read_bytes()
        b'hi'
    """

    def write_to(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)

    return atomic_write_path(final, write_to)


def atomic_write_path(final: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Like :func:`atomic_write_file` for writers that want a path (``write(temporary_path)``)."""
    final = Path(final)
    with explain_os_errors(final):
        remove_stale_temporaries(final.parent, name=final.name)  # left by a killed save of this file
        tmp = temporary_name(final)
        try:
            write(tmp)
            fsync_file(tmp)
            os.replace(tmp, final)
        except BaseException:
            _remove_quietly(tmp)
            raise
        fsync_folder(final.parent)
    return final


def remove_tree(path: Path) -> None:
    """Delete a folder so that no half-deleted folder ever sits under a name discovery would pick.

    The folder is first renamed to a temporary name (atomic), then deleted.
    """
    if path.is_symlink():
        path.unlink()  # never follow a link out of the folder
        return
    if not path.exists():
        return
    doomed = path if is_temporary(path) else temporary_name(path)
    if doomed != path:
        os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_stale_temporaries(folder: Path, *, name: str | None = None) -> list[Path]:
    """Delete temporary entries in ``folder`` left by processes of this host that are gone.

    Args:
        folder: where to look.
        name: only the temporaries of this final name (e.g. ``"w.safetensors"``); all by default.

    Temporaries of other hosts are left alone: whether their writer still runs is unknown here.

    Returns:
        The entries that were removed.
    """
    removed = []
    host = socket.gethostname().replace(".", "_")
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    for entry in entries:
        if not is_temporary(entry) or (name is not None and not entry.name.startswith(f".{name}{TEMP_MARKER}")):
            continue
        # Name: .<final name>.tmp-<host>-<pid>-<random>; the host may itself contain dashes.
        parts = entry.name.split(TEMP_MARKER, 1)[1].rsplit("-", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        if _pid_alive(int(parts[1])):
            continue
        _remove_quietly(entry)
        removed.append(entry)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


@contextlib.contextmanager
def explain_os_errors(final: Path) -> Iterator[None]:
    """Turn an OSError (anywhere in the raised error's chain) into a CheckpointError explaining it."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        cause = _os_error_in_chain(exc)
        if cause is None:
            raise
        raise CheckpointError(_explain(cause, final)) from exc


def _os_error_in_chain(exc: BaseException | None) -> OSError | None:
    # Writers wrap the OSError of a failed write: torch.save's zip writer raises a RuntimeError
    # while closing, with the OSError as its context.
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _explain(exc: OSError, final: Path) -> str:
    folder = final.parent
    if exc.errno in _SPACE_ERRNOS:
        return (
            f"could not write checkpoint {str(final)!r}: {exc.strerror} (errno {exc.errno}). The disk "
            f"holding {str(folder)!r} is full or a file-size/quota limit was hit. The previous "
            "checkpoint is unchanged. Free space there, lower keep_last, or save to another folder."
        )
    if exc.errno in _PERMISSION_ERRNOS:
        return (
            f"could not write checkpoint {str(final)!r}: the folder {str(folder)!r} is not writable "
            f"({exc.strerror}). The previous checkpoint is unchanged. Fix the folder's permissions "
            "or save to a folder this process may write to."
        )
    if exc.errno == errno.ENOENT and not folder.exists():
        return (
            f"could not write checkpoint {str(final)!r}: the folder {str(folder)!r} does not exist. "
            "Create it first (mkdir -p) or pick an existing folder."
        )
    return f"could not write checkpoint {str(final)!r}: {exc}. The previous checkpoint is unchanged."
