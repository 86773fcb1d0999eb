"""Read and check a safetensors header ourselves, before the safetensors library sees the file.

A safetensors file is an 8-byte little-endian header length, a JSON header, then one data
section in which every tensor owns the byte range ``data_offsets`` (relative to the section).
The library refuses malformed files with its own ``SafetensorError``; we check everything it
would check first, so every damaged file is a :class:`~multigpu.errors.CheckpointError` that
names the file and what is wrong, and nothing is read beyond the header.

Rules (those of the format): the header is at most 100 MB and fits in the file; it is a JSON
object without duplicate keys; ``__metadata__`` maps strings to strings; every other entry has
exactly ``dtype`` (one we know), ``shape`` (non-negative ints) and ``data_offsets``
(``[begin, end]``, ``end - begin`` = the tensor's byte size); the ranges, sorted, tile the data
section exactly: no gap, no overlap, nothing past its end, nothing after it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import torch

from multigpu.errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
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
    with open(path, "rb") as f:
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
    numel = 1
    for dim in shape:
        numel *= dim
    expected = numel * torch_dtype.itemsize
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
    raise CheckpointError(f"{str(Path(path))!r} is not a valid safetensors file: {what}.")
