"""A safetensors file's header, checked before anything else reads the file, and the checksum of a file saved alone.

The header. The safetensors library refuses most malformed files with a ``SafetensorError`` that
names neither the file nor the fix, and accepts some (duplicate keys; a data section that is also
a zip archive), so the header is checked here first, by the format's rules (see
docs/checkpoints.md, "Safe loading"); nothing is read beyond it.

The checksum. A file ``multigpu.save`` writes has no folder to hold a manifest, so it carries
``"multigpu.checksum": "crc32:HHHHHHHH:TTTTTTTT"`` in its header metadata (a step folder's
``model.safetensors`` does not: its ``manifest.json`` holds its CRC-32, :mod:`manifest`; folders
written before manifests carry this one). ``H`` covers what the header says (every tensor's name,
dtype and shape, and the other metadata), so it is checked from the header alone (``ckpt
inspect``); ``T`` covers every tensor's bytes (a CRC-32 of the CRC-32s of every tensor's 4 MiB pieces). Byte offsets are not
covered: a damaged offset breaks the header's tiling or moves other bytes under a tensor, which
``T`` catches. The CRC-32s come from the tensors in memory, computed in threads while the file is
written or read (zlib releases the GIL); ``T`` is written as zeros and patched in place once known
(:func:`stamp`). Files from elsewhere carry no checksum and are read as they are.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import numpy as np
import torch

from multigpu.checkpoint.file_kinds import MAX_HEADER_BYTES, open_regular, refuse
from multigpu.checkpoint.manifest import PIECE
from multigpu.errors import CheckpointError

MAX_DIMS = 64
METADATA_KEY = "__metadata__"


def _known_dtypes() -> dict[str, torch.dtype]:
    names = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "U16": "uint16",
        "F16": "float16",
        "BF16": "bfloat16",
        "I32": "int32",
        "U32": "uint32",
        "F32": "float32",
        "I64": "int64",
        "U64": "uint64",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
    }
    # Newer dtypes exist only in newer torch builds; a file using one this torch lacks is refused.
    return {code: getattr(torch, name) for code, name in names.items() if hasattr(torch, name)}


DTYPES = _known_dtypes()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it; offsets are relative to the data section."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A checked header: tensors in header order, metadata, and where the data section starts."""

    entries: list[TensorEntry]
    metadata: dict[str, str]
    data_start: int  # byte offset of the data section in the file
    file_size: int


def read_header(path: str | os.PathLike[str]) -> Header:
    """The header of the safetensors file at ``path``, checked; reads only the header bytes.

    Raises:
        CheckpointError: the file is not a well-formed safetensors file; the message names the
            file and the first rule it breaks.

    Example:
        >>> import tempfile, safetensors.torch
        >>> p = Path(tempfile.mkdtemp()) / "w.safetensors"
        >>> safetensors.torch.save_file({"w": torch.zeros(2, 3)}, str(p))
        >>> [(e.key, e.shape, e.nbytes) for e in read_header(p).entries]
        [('w', (2, 3), 24)]
    """
    with open_regular(path) as f:
        return read_header_from(f, path)


def read_header_from(f: BinaryIO, path: str | os.PathLike[str]) -> Header:
    """Like :func:`read_header`, from an open file (so header and data come from one file)."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        _fail(path, f"it is {size} bytes long, shorter than the 8-byte header length")
    f.seek(0)
    (length,) = struct.unpack("<Q", f.read(8))
    if length < 2 or length > MAX_HEADER_BYTES:
        _fail(path, f"its header length is {length} bytes; expected 2 to {MAX_HEADER_BYTES}")
    if length > size - 8:
        _fail(path, f"its header claims {length} bytes but only {size - 8} follow (truncated?)")
    raw = f.read(length)
    data_start = 8 + length
    parsed = _parse_json(path, raw)
    metadata = _metadata(path, parsed.pop(METADATA_KEY, None))
    entries = [_entry(path, key, value) for key, value in parsed.items()]
    _check_tiling(path, entries, size - data_start)
    return Header(entries=entries, metadata=metadata, data_start=data_start, file_size=size)


def _parse_json(path: str | os.PathLike[str], raw: bytes) -> dict[str, Any]:
    if raw[:1] != b"{":
        _fail(path, f"its header does not start with '{{' (found {raw[:16]!r})")
    try:
        parsed = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        _fail(path, f"its header is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})")
    if not isinstance(parsed, dict):
        _fail(path, f"its header is a JSON {type(parsed).__name__}, expected an object")
    return parsed


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:100]!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _metadata(path: str | os.PathLike[str], found: Any) -> dict[str, str]:
    if found is None:
        return {}
    if not isinstance(found, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        _fail(path, f"its {METADATA_KEY} is {_short(found)}; expected an object of strings to strings")
    return dict(found)


def _entry(path: str | os.PathLike[str], key: str, value: Any) -> TensorEntry:
    where = f"tensor {key[:200]!r}"
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        _fail(path, f"{where} is {_short(value)}; expected an object with dtype, shape and data_offsets")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        _fail(path, f"{where} has dtype {_short(dtype)}; expected one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        _fail(path, f"{where} has shape {_short(shape)}; expected a list of at most {MAX_DIMS} ints >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        _fail(path, f"{where} has data_offsets {_short(offsets)}; expected [begin, end], ints >= 0")
    begin, end = offsets
    torch_dtype = DTYPES[dtype]
    expected = math.prod(shape) * torch_dtype.itemsize
    if end - begin != expected:
        _fail(path, f"{where} spans bytes {begin}-{end} ({end - begin} bytes) but {dtype} {shape} needs {expected}")
    return TensorEntry(key=key, dtype=torch_dtype, shape=tuple(shape), begin=begin, end=end)


def _check_tiling(path: str | os.PathLike[str], entries: list[TensorEntry], data_bytes: int) -> None:
    position, previous = 0, ""
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin < position:
            _fail(path, f"tensors {previous!r} and {entry.key!r} overlap (bytes {entry.begin}-{position})")
        if entry.begin > position:
            _fail(path, f"bytes {position}-{entry.begin} of the data section belong to no tensor")
        if entry.end > data_bytes:
            _fail(
                path,
                f"tensor {entry.key!r} ends at byte {entry.end} but the data section holds {data_bytes} (truncated?)",
            )
        position, previous = entry.end, entry.key
    if position != data_bytes:
        _fail(path, f"{data_bytes - position} bytes follow the last tensor; the file is not a plain safetensors file")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(path: str | os.PathLike[str], what: str) -> NoReturn:
    refuse(path, f" is not a valid safetensors file: {what}")


# --- the checksum ---

CHECKSUM_KEY = "multigpu.checksum"
_CHECKSUM_VALUE = re.compile(r"crc32:[0-9a-f]{8}:[0-9a-f]{8}")
_UNSET = "00000000"

Described = Sequence[tuple[str, torch.dtype, tuple[int, ...]]]


def placeholder(described: Described, metadata: Mapping[str, str]) -> str:
    """The checksum value to write in the header: its header part, and zeros for the tensors (see :func:`stamp`)."""
    return f"crc32:{_header_crc(described, metadata):08x}:{_UNSET}"


def submit_crcs(pool: Executor, tensor: torch.Tensor) -> list[Future[int]]:
    """Start the CRC-32s of ``tensor``'s bytes, one per 4 MiB chunk, on ``pool`` (zlib releases the GIL)."""
    flat = tensor.detach().reshape(-1)
    if not packed(flat):  # is_contiguous() takes one element at a stride of 2 as contiguous; a byte view does not
        flat = flat.clone(memory_format=torch.contiguous_format)
    data = flat.view(torch.uint8).numpy()
    return [pool.submit(_crc, data[start : start + PIECE]) for start in range(0, max(len(data), 1), PIECE)]


def packed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements lie in row-major order with no gaps, each stride exactly that order's."""
    expected = 1
    for size, stride in reversed(list(zip(tensor.shape, tensor.stride()))):
        if stride != expected:
            return False
        expected *= size
    return True


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
        refuse(
            path,
            " is damaged: its header (tensor names, dtypes, shapes or metadata) does not match the checksum it was written with",
        )


def verify_tensors(
    path: str | os.PathLike[str], crcs: Mapping[str, Sequence[int]], metadata: Mapping[str, str]
) -> None:
    """Check the tensor part of a stored checksum against the CRC-32s of the tensors read from ``path``."""
    stored = _stored(path, metadata)
    if stored is not None and f"{combined(crcs):08x}" != stored[1]:
        refuse(path, " is damaged: its tensor data does not match the checksum it was written with")


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
    if not _CHECKSUM_VALUE.fullmatch(stored):
        refuse(path, f" has a malformed {CHECKSUM_KEY!r} entry ({stored[:60]!r})")
    _, header, tensors = stored.split(":")
    return header, tensors


def _refuse_a_damaged_entry(path: str | os.PathLike[str], metadata: Mapping[str, str]) -> None:
    # Damage to the entry's name would otherwise make the file look like one without a checksum.
    # A flipped byte keeps the name's length; an inserted or deleted one breaks the header's tiling.
    for key, value in metadata.items():
        near = len(key) == len(CHECKSUM_KEY) and sum(a != b for a, b in zip(key, CHECKSUM_KEY)) <= 3
        if near or _CHECKSUM_VALUE.fullmatch(value):
            refuse(path, f" is damaged: its metadata entry {key[:40]!r} looks like a damaged {CHECKSUM_KEY!r}")
