"""Read a file another process of the run left behind, trusting nothing about it.

The launcher and the workers read what the others wrote into the run's folders (failure records,
ledgers of collectives, stack dumps, stderr copies, torchrun's log files). Whatever is there may be
garbage: a half-written record, a file of another run, a named pipe or a link to ``/dev/zero`` (an
``open`` that waits for a writer forever, a read that never ends), gigabytes, bytes that are not
UTF-8, JSON nested a million deep or holding ``1e999``. A summary that crashes or hangs on one of them
hides the failure it was written to explain. So every such read goes through here: regular files only
(opened without blocking, checked on the open descriptor), at most a given number of bytes, JSON
parsed with finite numbers and bounded nesting. Anything else raises :class:`UnreadableFile`, whose
message says why; the caller names the file in its summary and goes on without it.

Example::

    data = read_json(folder / "attempt-0-rank-1.json", limit=1 << 20)   # or UnreadableFile
    tail = read_tail(folder / "attempt-0-rank-1.stderr", keep=16_000)   # "" when unreadable
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any

_KINDS = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


class UnreadableFile(ValueError):
    """A file of the run that is not what its writer writes (the message says what it is instead)."""


def read_bytes(path: str | os.PathLike[str], *, limit: int, tail: bool = False) -> bytes:
    """At most ``limit`` bytes of the regular file ``path``: all of it, or with ``tail`` its last ``limit``.

    Raises:
        UnreadableFile: it is not a regular file, cannot be opened, or (without ``tail``) holds more
            than ``limit`` bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO opens at once
    except OSError as exc:
        raise UnreadableFile(f"cannot be opened ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)  # the descriptor's, so a path swapped after the open cannot slip through
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFile(f"it is {_KINDS.get(stat.S_IFMT(info.st_mode), 'not a regular file')}")
        if info.st_size > limit and not tail:
            raise UnreadableFile(f"it holds {info.st_size} bytes, more than the {limit} bytes its writer writes")
        if tail and info.st_size > limit:
            os.lseek(fd, info.st_size - limit, os.SEEK_SET)
        data = _read_at_most(fd, limit + 1)  # one more: a file that grew past the limit since fstat
    except OSError as exc:
        raise UnreadableFile(f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        if not tail:
            raise UnreadableFile(f"it holds more than the {limit} bytes its writer writes")
        data = data[-limit:]
    return data


def read_tail(path: str | os.PathLike[str], *, keep: int) -> str:
    """The last ``keep`` bytes of the regular file ``path`` as text (undecodable bytes replaced), "" when unreadable."""
    try:
        return read_bytes(path, limit=keep, tail=True).decode(errors="replace")
    except UnreadableFile:
        return ""


def read_json(path: str | os.PathLike[str], *, limit: int) -> Any:
    """The JSON document in the regular file ``path``, of at most ``limit`` bytes, UTF-8, finite numbers only.

    The caller checks the document's shape (a mapping where one belongs, each field of its type): only
    then does a value reach arithmetic or formatting.

    Raises:
        UnreadableFile: as :func:`read_bytes`, or not UTF-8, not JSON, nested deeper than the parser
            recurses, or holding a number that is not finite (``1e999``, ``NaN``).
    """
    return parse_json(read_bytes(path, limit=limit))


def parse_json(data: bytes) -> Any:
    """``data`` as JSON under the rules of :func:`read_json` (raises :class:`UnreadableFile`)."""
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise UnreadableFile(f"it is not UTF-8 text (byte {exc.start})") from None
    try:
        # deep nesting ends in the parser's RecursionError, at the interpreter's recursion limit, at once
        return json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise UnreadableFile(f"it is not the JSON its writer writes ({str(exc)[:200]})") from None


def field(data: Any, name: str, kind: type, default: Any = None) -> Any:
    """``data[name]`` when ``data`` is a mapping and the value is a ``kind`` (an int is no bool), else raise.

    ``default`` stands for a missing field (None: the field is required).

    Raises:
        UnreadableFile: ``data`` is not a mapping, or the field is missing or of another type.
    """
    if not isinstance(data, dict):
        raise UnreadableFile(f"it holds a {type(data).__name__} where its writer writes a mapping")
    if name not in data and default is not None:
        return default
    value: Any = data.get(name)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        shown = "missing" if name not in data else f"a {type(value).__name__}"
        raise UnreadableFile(f"its field {name!r} is {shown}, not a {kind.__name__}")
    if isinstance(value, int) and not -(2**63) <= value < 2**64:  # what C's integers hold (a thread id is unsigned)
        raise UnreadableFile(f"its field {name!r} is a number out of range ({len(str(value))} digits)")
    return value


def entries(folder: str | os.PathLike[str], pattern: str) -> list[Path]:
    """The names in ``folder`` matching ``pattern`` (glob), by name; [] when the folder cannot be listed."""
    try:
        return sorted(Path(folder).glob(pattern))
    except OSError:
        return []


def modified_ns(path: Path) -> int:
    """``path``'s own modification time (a link's, not its target's), 0 when it is gone."""
    try:
        return path.lstat().st_mtime_ns
    except OSError:
        return 0


def write_replacing(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all, never through what is already at the partial's name.

    The partial file is created exclusively (``O_EXCL``: a FIFO, a link or a stale file left there is
    removed first and never opened, so the writer cannot block on a pipe or write through a link), then
    renamed over ``path``.

    Raises:
        OSError: it could not be written (``path`` is left as it was).
    """
    target = Path(path)
    # named by process and thread: two threads of one process writing the same file each keep their own
    partial = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    partial.unlink(missing_ok=True)
    try:
        with open(partial, "x", encoding="utf-8") as file:
            file.write(text)
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def remove_partials(path: str | os.PathLike[str]) -> None:
    """Remove the partial files :func:`write_replacing` left beside ``path`` (a writer killed between its write
    and its rename). Only for a caller that knows no writer of ``path`` is inside a write now (it holds the
    writers' turn: :mod:`multigpu.core.folder_turns`); other names, and anything but a regular file, are left."""
    target = Path(path)
    pattern = re.compile(re.escape(target.name) + r"\.\d+\.\d+\.tmp")
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def open_appending(path: str | os.PathLike[str]) -> int:
    """A descriptor appending to the regular file ``path`` (created when missing); never a pipe, device or link.

    Raises:
        OSError: ``path`` is something else (a FIFO planted there would block the writer), or cannot be opened.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o644)  # O_NONBLOCK: a FIFO without a reader fails at once (ENXIO)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"{path} is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read_at_most(fd: int, count: int) -> bytes:
    chunks: list[bytes] = []
    while count > 0:
        chunk = os.read(fd, min(count, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is not finite")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number its writer writes")
