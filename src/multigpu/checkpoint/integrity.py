"""Checksums, so that a damaged checkpoint is refused instead of loading with wrong numbers.

A flipped bit in a tensor's bytes leaves a perfectly well-formed file; only a checksum tells.

* safetensors files multigpu writes carry ``"multigpu.checksum": "crc32:HHHHHHHH:TTTTTTTT"`` in
  their header metadata. ``H`` covers what the header says (every tensor's name, dtype and shape,
  and the other metadata), so it is checked from the header alone (``ckpt inspect``); ``T`` covers
  every tensor's bytes, checked on the tensors just read, so no extra pass over the file is made.
  Both are computed from the tensors in memory before writing, one CRC-32 per tensor, in threads
  (zlib releases the GIL). Byte offsets are not covered: a damaged offset breaks the header's
  tiling or moves other bytes under a tensor, which ``T`` catches.
* torch files are zip archives with a CRC-32 per record; :func:`verify_zip_records` reads every
  record through :mod:`zipfile`, which checks them.
* a Checkpointer's ``state.pt`` records the checksum of its ``model.safetensors``, so weights
  and training state of different saves are never resumed together.

Files from elsewhere carry no checksum and are read as they are.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from multigpu.errors import CheckpointError

CHECKSUM_KEY = "multigpu.checksum"
_CHECKSUM_VALUE = re.compile(r"crc32:[0-9a-f]{8}:[0-9a-f]{8}")
_CHUNK = 16 << 20
_THREADS = min(4, os.cpu_count() or 1)


def checksum_of(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> str:
    """The checksum value to store with ``tensors`` (contiguous) and ``metadata``.

    Example:
        >>> checksum_of({"w": torch.zeros(2)}, {"format": "pt"}).startswith("crc32:")
        True
    """
    described = [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]
    return f"crc32:{_header_crc(described, metadata):08x}:{_tensors_crc(tensors):08x}"


def verify_header(
    path: str | os.PathLike[str],
    described: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    metadata: Mapping[str, str],
) -> None:
    """Check the header part of a stored checksum (no-op for files without one)."""
    stored = _stored(path, metadata)
    if stored is not None and f"{_header_crc(described, metadata):08x}" != stored[0]:
        raise _damaged(path, "header (tensor names, dtypes, shapes or metadata)")


def verify_tensors(
    path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> None:
    """Check the tensor part of a stored checksum on the tensors read from ``path``."""
    stored = _stored(path, metadata)
    if stored is not None and f"{_tensors_crc(tensors):08x}" != stored[1]:
        raise _damaged(path, "tensor data")


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


def _header_crc(described: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]) -> int:
    canonical = {
        "tensors": sorted([key, str(dtype), list(shape)] for key, dtype, shape in described),
        "metadata": sorted([k, v] for k, v in metadata.items() if k != CHECKSUM_KEY),
    }
    return zlib.crc32(json.dumps(canonical, separators=(",", ":")).encode())


def _tensors_crc(tensors: Mapping[str, torch.Tensor]) -> int:
    keys = sorted(tensors)
    with ThreadPoolExecutor(_THREADS) as pool:
        crcs = list(pool.map(lambda key: _crc_of(tensors[key]), keys))
    return zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs))


def _crc_of(tensor: torch.Tensor) -> int:
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return zlib.crc32(flat.view(torch.uint8).numpy().data)


def _stored(path: str | os.PathLike[str], metadata: Mapping[str, str]) -> tuple[str, str] | None:
    stored = metadata.get(CHECKSUM_KEY)
    if stored is None:
        _refuse_a_damaged_entry(path, metadata)
        return None
    parts = stored.split(":")
    if len(parts) != 3 or parts[0] != "crc32" or not all(len(p) == 8 and _is_hex(p) for p in parts[1:]):
        raise CheckpointError(f"{str(Path(path))!r} has a malformed {CHECKSUM_KEY!r} entry ({stored[:60]!r}).")
    return parts[1], parts[2]


def _refuse_a_damaged_entry(path: str | os.PathLike[str], metadata: Mapping[str, str]) -> None:
    # Damage to the entry's name would otherwise make the file look like one without a checksum.
    # A flipped byte keeps the name's length; an inserted or deleted one breaks the header's tiling.
    for key, value in metadata.items():
        near = len(key) == len(CHECKSUM_KEY) and sum(a != b for a, b in zip(key, CHECKSUM_KEY)) <= 3
        if near or _CHECKSUM_VALUE.fullmatch(value):
            raise CheckpointError(
                f"{str(Path(path))!r} is damaged: its metadata entry {key[:40]!r} looks like a damaged "
                f"{CHECKSUM_KEY!r}. Use another checkpoint, or re-save this one from its source."
            )


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _damaged(path: str | os.PathLike[str], part: str) -> CheckpointError:
    return CheckpointError(
        f"{str(Path(path))!r} is damaged: its {part} does not match the checksum it was written with. "
        "Use another checkpoint, or re-save this one from its source."
    )
