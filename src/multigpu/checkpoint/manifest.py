"""``manifest.json``: the one checksum scheme of a step folder, each file of its storage with its size and CRC-32.

Both storages write one into the temporary folder before it is sealed (:mod:`one_file`: ``model.safetensors``;
:mod:`dcp`: DCP's shards and index), atomically, and ``state.pt`` records its digest
(:attr:`Manifest.digest`), so weights and state of different saves are refused. Resume, ``multigpu.load``
of a step folder and ``ckpt convert`` check every listed file's size and CRC-32 before reading it;
``ckpt inspect`` checks the sizes (it reads headers only).

A file's CRC-32 is the CRC-32 of its bytes, taken over 4 MiB pieces in threads (zlib releases the GIL)
and the pieces' values joined (:func:`combine`), so a file is read once, at disk speed. The one-file
storage takes the pieces' values from the tensors in memory while the file is written (:mod:`formats`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from multigpu.checkpoint.atomic import FIX, MAX_STEP, MAX_WORLD_SIZE, atomic_write_file
from multigpu.checkpoint.file_kinds import entry_is, open_regular, refuse
from multigpu.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
VERSION = 1
PIECE = 4 << 20  # the CRC-32 of a file is taken in pieces of this size, in parallel
THREADS = min(4, os.cpu_count() or 1)
_MAX_BYTES = 16 << 20
_NAME = re.compile(r"\.?[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}", re.ASCII)  # a plain name inside the folder
_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reversed as zlib computes it


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    """What the manifest records of one file."""

    nbytes: int
    crc32: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A checked ``manifest.json``: the storage's format, the step, the world size that saved, and its files."""

    format: str
    step: int
    world_size: int
    files: dict[str, FileRecord]

    @property
    def digest(self) -> str:
        """The checksum ``state.pt`` records as its ``model_checksum``: one CRC-32 over every file's name, size and CRC-32."""
        table = json.dumps({n: [r.nbytes, r.crc32] for n, r in sorted(self.files.items())}, separators=(",", ":"))
        return f"{self.format}:crc32:{zlib.crc32(table.encode()):08x}"


def write_manifest(folder: Path, *, format: str, step: int, world_size: int, files: dict[str, FileRecord]) -> str:
    """Write ``manifest.json`` atomically into ``folder`` (main process); returns its digest."""
    body = {
        "format": format,
        "version": VERSION,
        "step": step,
        "world_size": world_size,
        "files": {name: {"bytes": r.nbytes, "crc32": f"{r.crc32:08x}"} for name, r in sorted(files.items())},
    }
    text = json.dumps(body, indent=1).encode()

    def write(f: BinaryIO) -> None:
        f.write(text)

    atomic_write_file(folder / MANIFEST_FILE, write)
    return Manifest(format=format, step=step, world_size=world_size, files=files).digest


def read_manifest(folder: Path, *, format: str | None, required: str) -> Manifest:
    """The checked manifest of ``folder``, written by the storage ``format`` (any: ``None``); it must list ``required``.

    Raises:
        CheckpointError: it is missing, too large, not JSON, of another storage, or a field is wrong.
    """
    path = folder / MANIFEST_FILE
    try:
        with open_regular(path) as f:
            raw = f.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc.strerror or exc}. {FIX}") from exc
    if len(raw) > _MAX_BYTES:
        bad(path, "its size", f"more than {_MAX_BYTES} bytes", "a small JSON file")
    try:
        # UTF-8 as written (json.loads would also take UTF-16 and -32); ValueError covers a number of
        # more digits than Python converts (4300), RecursionError a deep nesting.
        body = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({exc}); the checkpoint is damaged. {FIX}") from exc
    if not isinstance(body, dict):
        bad(path, "the manifest", body, "a JSON object")
    found = body.get("format")
    if found != (format or found) or not isinstance(found, str) or body.get("version") != VERSION:
        bad(path, "'format'/'version'", (found, body.get("version")), f"({format or 'a storage'!r}, {VERSION})")
    step, world = body.get("step"), body.get("world_size")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        bad(path, "'step'", step, f"an int from 0 to {MAX_STEP}")
    if type(world) is not int or not 1 <= world <= MAX_WORLD_SIZE:
        bad(path, "'world_size'", world, f"an int from 1 to {MAX_WORLD_SIZE}")
    entries = body.get("files")
    if not isinstance(entries, dict) or required not in entries:
        bad(path, "'files'", entries, f"an object naming every file of the storage, {required!r} included")
    files = {}
    for name, entry in entries.items():
        if not _NAME.fullmatch(name) or name == MANIFEST_FILE:
            bad(path, "a file name", name, "a plain name inside the folder")
        nbytes = entry.get("bytes") if isinstance(entry, dict) else None
        crc = entry.get("crc32") if isinstance(entry, dict) else None
        if type(nbytes) is not int or nbytes < 0 or not (isinstance(crc, str) and re.fullmatch(r"[0-9a-f]{8}", crc)):
            bad(path, f"the entry of {name!r}", entry, '{"bytes": <int>, "crc32": "<8 hex digits>"}')
        files[name] = FileRecord(nbytes=nbytes, crc32=int(crc, 16))
    return Manifest(format=found, step=step, world_size=world, files=files)


def bad(path: Path, entry: str, found: Any, expected: str) -> NoReturn:
    """Refuse the damaged field ``entry`` of a checkpoint's file at ``path``."""
    refuse(path, entry_is(entry, found, expected) + ". The checkpoint is damaged", FIX)


def check_sizes(folder: Path, manifest: Manifest) -> dict[str, int]:
    """Every file the manifest lists is in ``folder`` with its recorded size; returns the sizes (reads no data).

    Raises:
        CheckpointError: naming the first file that is missing or of another size.
    """
    sizes = file_sizes(folder, sorted(manifest.files))
    for name, record in sorted(manifest.files.items()):
        if sizes[name] != record.nbytes:
            raise CheckpointError(
                f"{str(folder / name)!r} has {sizes[name]} bytes; the manifest records {record.nbytes} (the file "
                f"was truncated or replaced). {FIX}"
            )
    return sizes


def file_sizes(folder: Path, names: Iterable[str]) -> dict[str, int]:
    """The sizes of the files ``names`` of a checkpoint in ``folder``; a CheckpointError names one missing."""
    sizes = {}
    for name in names:
        try:
            sizes[name] = os.stat(folder / name).st_size
        except OSError as exc:
            raise CheckpointError(
                f"{str(folder / name)!r}, a file of the checkpoint, is missing or unreadable ({exc.strerror or exc}). "
                f"{FIX}"
            ) from exc
    return sizes


def check_crcs(folder: Path, manifest: Manifest, names: Iterable[str]) -> None:
    """The files ``names`` (listed in the manifest) have the CRC-32 it records.

    Raises:
        CheckpointError: naming the first file whose bytes changed.
    """
    for name in names:
        try:
            found = file_record(folder / name)
        except OSError as exc:  # a pipe or a folder where a file was
            raise CheckpointError(f"cannot read {str(folder / name)!r}: {exc.strerror or exc}. {FIX}") from exc
        if found.crc32 != manifest.files[name].crc32:
            raise CheckpointError(
                f"{str(folder / name)!r} does not match the CRC-32 its manifest records: its bytes were changed "
                f"after the save (a damaged disk or copy). {FIX}"
            )


def check_listed(path: Path) -> None:
    """The CRC-32 of a file read on its own (``multigpu.load`` of ``step-N/model.safetensors``) against its folder's
    manifest, where one lists it; a ``manifest.json`` that is not one (another tool's) is left alone."""
    try:
        manifest = read_manifest(path.parent, format=None, required=path.name)
    except CheckpointError:
        return
    check_crcs(path.parent, manifest, [path.name])


def file_record(path: Path) -> FileRecord:
    """Size and CRC-32 of the file at ``path``, its 4 MiB pieces read and checksummed in threads."""
    with open_regular(path) as f, ThreadPoolExecutor(THREADS) as pool:
        fd, size = f.fileno(), os.fstat(f.fileno()).st_size
        pieces = list(pool.map(lambda start: _piece(fd, start), range(0, size, PIECE)))
    return FileRecord(nbytes=sum(n for _, n in pieces), crc32=combine(pieces))


def _piece(fd: int, start: int) -> tuple[int, int]:
    data = os.pread(fd, PIECE, start)
    return zlib.crc32(data), len(data)


def combine(pieces: Iterable[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive pieces of data, from each piece's ``(CRC-32, length)``.

    CRC-32 is linear over GF(2): the CRC of ``a + b`` is the CRC of ``a`` times ``x**(8 * len(b))``
    modulo the polynomial, plus the CRC of ``b``.

    Example:
        >>> combine([(zlib.crc32(b"check"), 5), (zlib.crc32(b"sum"), 3)]) == zlib.crc32(b"checksum")
        True
    """
    crc = 0
    for piece_crc, length in pieces:
        crc = _multiply(crc, _x_power(8 * length)) ^ piece_crc
    return crc


def _multiply(a: int, b: int) -> int:
    # Polynomials over GF(2) modulo CRC-32's, bit-reversed (the top bit is x**0), as zlib keeps them.
    product = 0
    for bit in range(31, -1, -1):
        if a >> bit & 1:
            product ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


@functools.lru_cache(maxsize=64)
def _x_power(n: int) -> int:
    # x**n modulo the polynomial, by squaring (most pieces have one length: cached).
    power, square = 1 << 31, 1 << 30  # x**0, x**1
    while n:
        if n & 1:
            power = _multiply(power, square)
        square, n = _multiply(square, square), n >> 1
    return power
