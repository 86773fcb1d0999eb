"""Checksums, so that a damaged checkpoint is refused instead of loading with wrong numbers.

A flipped bit in a tensor's bytes leaves a perfectly well-formed file; only a checksum tells.

* safetensors files multigpu writes carry ``"multigpu.checksum": "crc32:HHHHHHHH:TTTTTTTT"`` in
  their header metadata. ``H`` covers what the header says (every tensor's name, dtype and shape,
  and the other metadata), so it is checked from the header alone (``ckpt inspect``); ``T`` covers
  every tensor's bytes (a CRC-32 of the CRC-32s of every tensor's 4 MiB pieces). Byte offsets are not covered: a damaged
  offset breaks the header's tiling or moves other bytes under a tensor, which ``T`` catches.
  The CRC-32s come from the tensors in memory, computed in a thread while the file is written or
  read (zlib releases the GIL), so they cost little time and no extra pass over the file; ``T`` is
  written as zeros and patched in place once known (:func:`stamp`).
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
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path

import numpy as np
import torch

from multigpu.errors import CheckpointError

CHECKSUM_KEY = "multigpu.checksum"
_CHECKSUM_VALUE = re.compile(r"crc32:[0-9a-f]{8}:[0-9a-f]{8}")
_UNSET = "00000000"
_CHUNK = 16 << 20  # zip records are read in pieces of this size
_CRC_CHUNK = 4 << 20  # tensors are checksummed in pieces of this size, in parallel
THREADS = min(4, os.cpu_count() or 1)

Described = Sequence[tuple[str, torch.dtype, tuple[int, ...]]]


def placeholder(described: Described, metadata: Mapping[str, str]) -> str:
    """The checksum value to write in the header: its header part, and zeros for the tensors (see :func:`stamp`)."""
    return f"crc32:{_header_crc(described, metadata):08x}:{_UNSET}"


def submit_crcs(pool: Executor, tensor: torch.Tensor) -> list[Future[int]]:
    """Start the CRC-32s of ``tensor``'s bytes, one per 4 MiB chunk, on ``pool`` (zlib releases the GIL)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    data = flat.view(torch.uint8).numpy()
    return [pool.submit(_crc, data[start : start + _CRC_CHUNK]) for start in range(0, max(len(data), 1), _CRC_CHUNK)]


def tensor_crcs(pending: Mapping[str, list[Future[int]]]) -> dict[str, list[int]]:
    """The results of :func:`submit_crcs`, by key."""
    return {key: [future.result() for future in futures] for key, futures in pending.items()}


def combined(crcs: Mapping[str, Sequence[int]]) -> int:
    """One CRC-32 of every chunk's CRC-32, tensors in key order."""
    ordered = [crc for key in sorted(crcs) for crc in crcs[key]]
    return zlib.crc32(struct.pack(f"<{len(ordered)}I", *ordered))


def _crc(data: np.ndarray) -> int:
    return zlib.crc32(data.data)


def stamp(path: Path, crcs: Mapping[str, Sequence[int]]) -> str:
    """Fill the tensor part into the checksum of the safetensors file just written at ``path``.

    The value keeps its length, so it is patched in place: the tensors are never written twice.

    Returns:
        The complete checksum value.
    """
    with open(path, "r+b") as f:
        header = f.read(int.from_bytes(f.read(8), "little"))
        match = re.search(rb'"multigpu\.checksum":"(crc32:[0-9a-f]{8}:)00000000"', header)
        if match is None:
            raise CheckpointError(f"{str(path)!r}: the checksum placeholder is missing from the header just written.")
        value = f"{match.group(1).decode()}{combined(crcs):08x}"
        f.seek(8 + match.start(1))
        f.write(value.encode())
    return value


def verify_header(path: str | os.PathLike[str], described: Described, metadata: Mapping[str, str]) -> None:
    """Check the header part of a stored checksum (no-op for files without one)."""
    stored = _stored(path, metadata)
    if stored is not None and f"{_header_crc(described, metadata):08x}" != stored[0]:
        raise _damaged(path, "header (tensor names, dtypes, shapes or metadata)")


def verify_tensors(
    path: str | os.PathLike[str], crcs: Mapping[str, Sequence[int]], metadata: Mapping[str, str]
) -> None:
    """Check the tensor part of a stored checksum against the CRC-32s of the tensors read from ``path``."""
    stored = _stored(path, metadata)
    if stored is not None and f"{combined(crcs):08x}" != stored[1]:
        raise _damaged(path, "tensor data")


def _header_crc(described: Described, metadata: Mapping[str, str]) -> int:
    canonical = {
        "tensors": sorted([key, str(dtype), list(shape)] for key, dtype, shape in described),
        "metadata": sorted([k, v] for k, v in metadata.items() if k != CHECKSUM_KEY),
    }
    return zlib.crc32(json.dumps(canonical, separators=(",", ":")).encode())


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
