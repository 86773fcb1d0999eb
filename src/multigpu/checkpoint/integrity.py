"""Checksums, so that a damaged checkpoint is refused instead of loading with wrong numbers.

A flipped bit in a tensor's bytes leaves a perfectly well-formed file; only a checksum tells.

* safetensors files multigpu writes carry ``"multigpu.checksum": "crc32:HHHHHHHH:DDDDDDDD"`` in
  their header metadata: the CRC-32 of the length prefix and header (with this value as zeros)
  and the CRC-32 of the data section. The file is written with the zeros, then the value is
  patched in place (same length), so no second copy of the tensors is ever made. A reader
  checks the header part whenever it reads the header and the data part before using tensors.
* torch files are zip archives with a CRC-32 per record; :func:`verify_zip_records` reads every
  record through :mod:`zipfile`, which checks them.
* a Checkpointer's ``state.pt`` records the checksum of its ``model.safetensors``, so weights
  and training state of different saves are never resumed together.

Files from elsewhere carry no checksum and are read as they are.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path

from multigpu.errors import CheckpointError

CHECKSUM_KEY = "multigpu.checksum"
PLACEHOLDER = "crc32:00000000:00000000"
_CHUNK = 16 << 20


def stamp(path: Path) -> str:
    """Fill in the checksum of the safetensors file at ``path``, written with :data:`PLACEHOLDER`.

    Returns:
        The checksum value written.
    """
    with open(path, "r+b") as f:
        prefix = f.read(8)
        header = f.read(int.from_bytes(prefix, "little"))
        at = header.find(f'"{CHECKSUM_KEY}":"{PLACEHOLDER}"'.encode())
        if at < 0:
            raise CheckpointError(f"{str(path)!r}: the checksum placeholder is missing from the header just written.")
        value = _value(zlib.crc32(header, zlib.crc32(prefix)), _crc_from(f, 8 + len(header)))
        f.seek(8 + at + len(CHECKSUM_KEY) + 4)
        f.write(value.encode())
    return value


def verify_header(path: str | os.PathLike[str], prefix: bytes, header: bytes, metadata: dict[str, str]) -> None:
    """Check the header part of a stored checksum (no-op for files without one)."""
    stored = metadata.get(CHECKSUM_KEY)
    if stored is None:
        return
    _check_format(path, stored)
    blank = header.replace(f'"{CHECKSUM_KEY}":"{stored}"'.encode(), f'"{CHECKSUM_KEY}":"{PLACEHOLDER}"'.encode(), 1)
    computed = f"{zlib.crc32(blank, zlib.crc32(prefix)):08x}"
    if blank == header or computed != stored.split(":")[1]:
        raise _damaged(path, "header", stored, computed)


def verify_data(path: str | os.PathLike[str], data_start: int, metadata: dict[str, str]) -> None:
    """Check the data part of a stored checksum by reading the data section once."""
    stored = metadata.get(CHECKSUM_KEY)
    if stored is None:
        return
    _check_format(path, stored)
    with open(path, "rb") as f:
        computed = f"{_crc_from(f, data_start):08x}"
    if computed != stored.split(":")[2]:
        raise _damaged(path, "data", stored, computed)


def verify_zip_records(path: str | os.PathLike[str], archive: zipfile.ZipFile) -> None:
    """Read every record of a torch zip through :mod:`zipfile`, which checks each CRC-32."""
    for info in archive.infolist():
        with archive.open(info) as record:
            try:
                while record.read(_CHUNK):
                    pass
            except zipfile.BadZipFile as exc:
                raise CheckpointError(
                    f"{str(Path(path))!r} is damaged: record {info.filename!r} does not match its CRC-32 ({exc}). "
                    "Use another checkpoint, or re-save this one from its source."
                ) from exc


def _crc_from(f, start: int) -> int:  # type: ignore[no-untyped-def]
    f.seek(start)
    crc = 0
    while chunk := f.read(_CHUNK):
        crc = zlib.crc32(chunk, crc)
    return crc


def _value(header_crc: int, data_crc: int) -> str:
    return f"crc32:{header_crc:08x}:{data_crc:08x}"


def _check_format(path: str | os.PathLike[str], stored: str) -> None:
    parts = stored.split(":")
    if len(parts) != 3 or parts[0] != "crc32" or not all(len(p) == 8 and _is_hex(p) for p in parts[1:]):
        raise CheckpointError(f"{str(Path(path))!r} has a malformed {CHECKSUM_KEY!r} entry ({stored[:60]!r}).")


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _damaged(path: str | os.PathLike[str], part: str, stored: str, computed: str) -> CheckpointError:
    return CheckpointError(
        f"{str(Path(path))!r} is damaged: its {part} does not match the checksum it was written with "
        f"({stored}, computed {computed} for the {part}). Use another checkpoint, or re-save this one from its source."
    )
