"""Put a complete folder under its final name so that the name never points at nothing.

A new step is one ``rename``. Replacing an existing step (a re-save of the same step) cannot be
one ``rename``: a folder cannot be renamed onto a non-empty folder. Instead:

* where the kernel and file system support it (Linux >= 3.15; ext4, xfs, btrfs, tmpfs, ...),
  ``renameat2(RENAME_EXCHANGE)`` swaps the two folders in one atomic step; the old one then
  sits under the temporary name and is deleted;
* elsewhere the old folder is first renamed to a hidden *aside* name that discovery reads as
  the same step (:mod:`naming`, :mod:`discovery`), then the new one is renamed in. A kill between
  the two renames leaves the old checkpoint findable under the aside name, and the next save
  puts it back (:func:`~multigpu.checkpoint.discovery.recover_asides`).

Either way, at every instant a complete copy of the step (old or new) is found.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

from multigpu.checkpoint.atomic import explain_os_errors, fsync_folder, remove_tree, temporary_name
from multigpu.checkpoint.naming import aside_name

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_SYSCALL_NUMBERS = {"x86_64": 316, "aarch64": 276}  # renameat2, for a libc without the wrapper
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM}

use_exchange = sys.platform.startswith("linux")  # tests turn it off to exercise the fallback


@contextlib.contextmanager
def atomic_folder(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Build a folder under a temporary name; on success it takes the name ``final`` (see above).

    Files written inside the yielded folder should be synced (see
    :func:`~multigpu.checkpoint.atomic.fsync_file`); the folder itself is synced here.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> with atomic_folder(root / "step-1") as tmp:
        ...     _ = (tmp / "a.txt").write_text("a")
        >>> sorted(p.name for p in root.iterdir())
        ['step-1']
    """
    final = Path(final)
    tmp = temporary_name(final)
    with explain_os_errors(final):
        try:
            tmp.mkdir()
            yield tmp
            fsync_folder(tmp)
            install_folder(tmp, final)
        except BaseException:
            remove_tree(tmp)
            raise


def install_folder(tmp: Path, final: Path) -> None:
    """Give the complete folder ``tmp`` the name ``final``, replacing a previous ``final`` atomically."""
    try:
        os.rename(tmp, final)  # atomic; fails if final is a non-empty folder
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    else:
        fsync_folder(final.parent)
        return
    if use_exchange and exchange(tmp, final):
        fsync_folder(final.parent)
        remove_tree(tmp)  # now the old step
        return
    aside = aside_name(final)
    os.rename(final, aside)
    fsync_folder(final.parent)  # the aside is durable before the name is reused
    os.rename(tmp, final)
    fsync_folder(final.parent)
    remove_tree(aside)


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; ``False`` where this system cannot.

    Raises:
        OSError: the exchange is supported but failed (e.g. a path vanished).
    """
    call = _renameat2()
    if call is None:
        return False
    result = call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _renameat2():  # type: ignore[no-untyped-def]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    wrapper = getattr(libc, "renameat2", None)
    if wrapper is not None:
        wrapper.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        wrapper.restype = ctypes.c_int
        return wrapper
    number = _SYSCALL_NUMBERS.get(platform.machine())
    if number is None:
        return None
    syscall = libc.syscall
    syscall.restype = ctypes.c_long

    def call(olddir: int, old: bytes, newdir: int, new: bytes, flags: int) -> int:
        return int(syscall(ctypes.c_long(number), olddir, old, newdir, new, ctypes.c_uint(flags)))

    return call
