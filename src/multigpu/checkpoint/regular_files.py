"""Open a checkpoint file for reading only if it is a regular file, never blocking on anything else.

``open()`` of a named pipe (FIFO) waits for a writer forever, and a character device such as
``/dev/zero`` or ``/dev/urandom`` never ends: a path that names one where a checkpoint file is
expected must be an error, not a hang. :func:`open_regular` opens without blocking, looks at what
it opened (``fstat`` of the descriptor, so a path swapped meanwhile cannot slip through), and only
then reads. Every reader of the checkpoint package opens through it.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_KINDS = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "rb")``, refusing anything but a regular file (symlinks are followed).

    Raises:
        IsADirectoryError: ``path`` is a folder (as ``open`` raises).
        OSError: ``path`` is a pipe, socket or device (``errno.EINVAL``; the message says which and
            the fix), or cannot be opened.

    Example:
        >>> open_regular("/dev/null")
        Traceback (most recent call last):
        ...
        OSError: [Errno 22] it is a character device, not a regular file; give the path of a checkpoint file: '/dev/null'
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO opens at once
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
            raise OSError(
                errno.EINVAL,
                f"it is {kind}, not a regular file; give the path of a checkpoint file",
                os.fspath(path),
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
