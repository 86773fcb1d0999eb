"""Opening a checkpoint file, telling what it is, and refusing it: the first thing every reader does.

Only regular files are read (:func:`open_regular`): ``open()`` of a named pipe (FIFO) waits for a
writer forever, and a character device such as ``/dev/zero`` never ends, so a path naming one where
a checkpoint file is expected is an error, not a hang. The file is opened without blocking and what
was opened is looked at (``fstat`` of the descriptor, so a path swapped meanwhile cannot slip through).

What a file is, its own structure decides, never its name or one byte. Every reader asks
:func:`kind_of` (through
:func:`~multigpu.checkpoint.formats.detect_format`, or :mod:`torch_file` for its messages):

* **safetensors**: an 8-byte little-endian header length ``n`` (2 to 100 MB) whose header fits in
  the file and reads as a JSON object: ``{`` at byte 8 and ``}`` as its last byte before the
  padding. The length's first byte may be anything, ``0x80`` (a pickle's first byte) or ``PK``
  (a zip's) included: a header of 128 + 256k bytes starts with ``0x80``.
* **torch zip** (``torch.save`` since 1.6): a zip local header at byte 0, or a zip directory at
  the end of the file (an archive with data prepended, which the torch reader then names).
* **legacy torch** (before 1.6): a pickle (protocol 2 to 5) of torch's magic number at the start.

A file that is none of these but has ``{`` at byte 8 is read as a damaged safetensors file, so that
its reader says what is wrong with the header (a length past the end, ...). Anything else is a
:class:`~multigpu.errors.CheckpointError` naming the file and its first bytes.

Every reader refuses a file through :func:`refuse`: one message shape, the file, what is wrong, the fix.
"""

from __future__ import annotations

import errno
import os
import reprlib
import stat
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Literal, NoReturn

from multigpu.errors import CheckpointError

Kind = Literal["safetensors", "torch zip", "legacy torch"]
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
REPLACE = "Use another checkpoint, or re-save this one from its source."
SHORT = reprlib.Repr()
SHORT.maxstring = SHORT.maxother = 60

ZIP_LOCAL_SIGNATURE = b"PK\x03\x04"
# torch's legacy format starts with a pickle of this number (torch/serialization.py, MAGIC_NUMBER),
# a LONG1 opcode (0x8a) of 10 bytes, after the protocol header and, from protocol 4, a frame header.
_TORCH_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_HEAD = 32  # bytes read from the start: the length, the header's '{', a legacy pickle's magic number
_TAIL = 4096  # bytes read back from the header's end to find its closing '}' before the padding
_JSON_SPACE = b" \t\r\n"


def kind_of(f: BinaryIO, path: str | os.PathLike[str]) -> Kind:
    """The kind of the open file ``f`` (named ``path`` in messages); reads at most a few KiB.

    Raises:
        CheckpointError: the file is none of the kinds above (empty, truncated to a few bytes, a
            plain pickle, text, ...).

    Example (a header of 128 bytes: the file's first byte is 0x80, as a pickle's):
        >>> import struct, tempfile
        >>> header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'.ljust(128)
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(struct.pack("<Q", 128) + header + bytes(4))
        ...     kind_of(f, "w.safetensors")
        'safetensors'
    """
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(_HEAD)
    if _is_safetensors(f, head, size):
        return "safetensors"  # (a polyglot, also a zip, is refused by the safetensors reader)
    if head[:4] == ZIP_LOCAL_SIGNATURE or is_zip(f):
        return "torch zip"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05") and _TORCH_MAGIC in head:
        return "legacy torch"
    if head[8:9] == b"{":
        return "safetensors"  # a damaged one: its reader names what is wrong with the header
    raise CheckpointError(
        f"{str(path)!r} is neither a safetensors nor a torch file (first bytes {head[:9]!r}); "
        "check the path, or whether the file was truncated."
    )


def _is_safetensors(f: BinaryIO, head: bytes, size: int) -> bool:
    if len(head) < 10:  # the length and at least "{}"
        return False
    length = int.from_bytes(head[:8], "little")
    if not 2 <= length <= MAX_HEADER_BYTES or length > size - 8 or head[8:9] != b"{":
        return False
    back = min(length - 1, _TAIL)
    f.seek(8 + length - back)
    return f.read(back).rstrip(_JSON_SPACE).endswith(b"}")


def is_zip(f: BinaryIO) -> bool:
    """Whether ``f`` has a zip directory (at its end: a zip with data prepended counts)."""
    try:
        return zipfile.is_zipfile(f)
    except OSError:
        return False


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


def refuse(path: str | os.PathLike[str], what: str, fix: str = REPLACE) -> NoReturn:
    """Raise the :class:`CheckpointError` of a file: ``'<path>'<what>. <fix>`` (``what`` starts with its own verb).

    Example:
        >>> refuse("w.pt", " is damaged: record 'a/data/0' does not match its CRC-32")
        Traceback (most recent call last):
        ...
        multigpu.errors.CheckpointError: 'w.pt' is damaged: record 'a/data/0' does not match its CRC-32. Use another checkpoint, or re-save this one from its source.
    """
    raise CheckpointError(f"{str(Path(path))!r}{what}. {fix}".rstrip())


def entry_is(entry: str, found: Any, expected: str) -> str:
    """``": <entry> is <found, shortened>; expected <expected>"``: what :func:`refuse` says of one field."""
    return f": {entry} is {SHORT.repr(found)}; expected {expected}"
