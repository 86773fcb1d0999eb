"""The files of a sharded checkpoint folder (fsdp), and the checks made before anything reads them.

A :class:`~multigpu.checkpoint.state.Checkpointer` saving a model sharded by fsdp writes its step
folder with ``torch.distributed.checkpoint`` (DCP), so no process ever holds the whole model:

    step-00000042/
      .metadata        DCP's index: each tensor's global shape and dtype, where each slice lies (rank 0)
      __0_0.distcp     rank 0's slices of the weights and optimizer state; __1_0.distcp rank 1's, ...
      state.pt         step, epoch, every rank's random state, scheduler, scaler, data position (as unsharded)
      manifest.json    the marker: {"format": "dcp", "step": 42, "world_size": 2, "files": {name: bytes, crc32}}

The folder is itself a DCP checkpoint (``torch.distributed.checkpoint.load`` reads it). The
manifest says which format the folder holds (discovery, pruning and ``ckpt inspect`` read it
without unpickling anything) and records every DCP file's size and CRC-32; ``state.pt`` records the
manifest's digest, so state and shards of different saves are never resumed together.

Before DCP reads a folder, multigpu checks it: the manifest's fields; ``.metadata`` (a pickle)
unpickled with only the classes DCP's index is made of, so it runs no code, then its fields; every
file present with its recorded size; every slice inside its file; every file's CRC-32. A failed check is a
:class:`~multigpu.errors.CheckpointError` naming the file and the fix.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from multigpu.checkpoint.atomic import atomic_write_file
from multigpu.checkpoint.naming import MAX_STEP
from multigpu.checkpoint.validate import MAX_WORLD_SIZE
from multigpu.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"  # DCP's name for its index
FORMAT = "dcp"
MANIFEST_VERSION = 1
MAX_METADATA_BYTES = 256 << 20  # an index of millions of tensors stays far below
_MAX_MANIFEST_BYTES = 16 << 20
_CHUNK = 4 << 20
_SHARD_NAME = re.compile(r"__([0-9]{1,8})_[0-9]{1,8}\.distcp", re.ASCII)
_DATA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}", re.ASCII)  # a plain name inside the folder
_FIX = (
    "Resume from another step (Checkpointer.resume(path=...)), or move this folder away so that the "
    "previous step is the latest."
)


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    """What the manifest records of one DCP file."""

    nbytes: int
    crc32: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A checked ``manifest.json``."""

    step: int
    world_size: int
    files: dict[str, FileRecord]

    @property
    def digest(self) -> str:
        """The checksum ``state.pt`` records as its ``model_checksum``."""
        return files_digest(self.files)


def is_sharded_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a manifest, i.e. is (meant to be) a sharded checkpoint."""
    return (folder / MANIFEST_FILE).is_file()


def is_dcp_folder(path: Path) -> bool:
    """Whether ``path`` is a folder holding a DCP checkpoint (DCP's index, or a sharded checkpoint's manifest)."""
    return path.is_dir() and ((path / METADATA_FILE).is_file() or is_sharded_folder(path))


def files_digest(files: dict[str, FileRecord]) -> str:
    """One CRC-32 over every file's name, size and CRC-32."""
    table = json.dumps({name: [r.nbytes, r.crc32] for name, r in sorted(files.items())}, separators=(",", ":"))
    return f"dcp:crc32:{zlib.crc32(table.encode()):08x}"


def file_crc32(path: Path) -> FileRecord:
    """Size and CRC-32 of the file at ``path``, read in 4 MiB pieces."""
    crc, nbytes = 0, 0
    with open(path, "rb") as f:
        while piece := f.read(_CHUNK):
            crc = zlib.crc32(piece, crc)
            nbytes += len(piece)
    return FileRecord(nbytes=nbytes, crc32=crc)


def own_files(folder: Path, rank: int) -> dict[str, FileRecord]:
    """The DCP files rank ``rank`` wrote into ``folder`` (``__<rank>_*.distcp``; rank 0 also ``.metadata``)."""
    names = [p.name for p in folder.iterdir() if (m := _SHARD_NAME.fullmatch(p.name)) and int(m.group(1)) == rank]
    if rank == 0 and (folder / METADATA_FILE).is_file():
        names.append(METADATA_FILE)
    return {name: file_crc32(folder / name) for name in sorted(names)}


def write_manifest(folder: Path, *, step: int, world_size: int, files: dict[str, FileRecord]) -> str:
    """Write ``manifest.json`` atomically into ``folder``; returns its digest."""
    body = {
        "format": FORMAT,
        "version": MANIFEST_VERSION,
        "step": step,
        "world_size": world_size,
        "files": {name: {"bytes": r.nbytes, "crc32": f"{r.crc32:08x}"} for name, r in sorted(files.items())},
    }
    text = json.dumps(body, indent=1).encode()

    def write(f: BinaryIO) -> None:
        f.write(text)

    atomic_write_file(folder / MANIFEST_FILE, write)
    return files_digest(files)


def read_manifest(folder: Path) -> Manifest:
    """The checked manifest of the sharded checkpoint ``folder``.

    Raises:
        CheckpointError: it is missing, too large, not JSON, or a field is wrong.
    """
    path = folder / MANIFEST_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc.strerror or exc}. {_FIX}") from exc
    if len(raw) > _MAX_MANIFEST_BYTES:
        _bad(path, "its size", f"more than {_MAX_MANIFEST_BYTES} bytes", "a small JSON file")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({exc}); the checkpoint is damaged. {_FIX}") from exc
    if not isinstance(body, dict):
        _bad(path, "the manifest", body, "a JSON object")
    if body.get("format") != FORMAT or body.get("version") != MANIFEST_VERSION:
        _bad(path, "'format'/'version'", (body.get("format"), body.get("version")), f"({FORMAT!r}, {MANIFEST_VERSION})")
    step, world = body.get("step"), body.get("world_size")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        _bad(path, "'step'", step, f"an int from 0 to {MAX_STEP}")
    if type(world) is not int or not 1 <= world <= MAX_WORLD_SIZE:
        _bad(path, "'world_size'", world, f"an int from 1 to {MAX_WORLD_SIZE}")
    entries = body.get("files")
    if not isinstance(entries, dict) or METADATA_FILE not in entries:
        _bad(path, "'files'", entries, f"an object naming every DCP file, {METADATA_FILE!r} included")
    files = {}
    for name, entry in entries.items():
        if name != METADATA_FILE and not _DATA_NAME.fullmatch(name):
            _bad(path, "a file name", name, "a plain name inside the folder")
        nbytes = entry.get("bytes") if isinstance(entry, dict) else None
        crc = entry.get("crc32") if isinstance(entry, dict) else None
        if type(nbytes) is not int or nbytes < 0 or not (isinstance(crc, str) and re.fullmatch(r"[0-9a-f]{8}", crc)):
            _bad(path, f"the entry of {name!r}", entry, '{"bytes": <int>, "crc32": "<8 hex digits>"}')
        files[name] = FileRecord(nbytes=nbytes, crc32=int(crc, 16))
    return Manifest(step=step, world_size=world, files=files)


def recorded_step(folder: Path) -> int | None:
    """The step the manifest of ``folder`` records, or ``None`` if it has no readable manifest."""
    try:
        return read_manifest(folder).step
    except (CheckpointError, OSError):
        return None


def _bad(path: Path, entry: str, found: Any, expected: str) -> NoReturn:
    shown = repr(found)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise CheckpointError(f"{str(path)!r}: {entry} is {shown}; expected {expected}. The checkpoint is damaged. {_FIX}")


# --- .metadata: DCP's pickled index, read without running code -------------------------------

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    """Rebuilds only what a DCP index is made of: its dataclasses, sizes, dtypes, layouts and paths."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")


def read_metadata(folder: Path) -> dcp_metadata.Metadata:
    """DCP's index of ``folder``, unpickled safely and checked field by field.

    Raises:
        CheckpointError: it is missing, too large, needs other classes than an index has, or a field
            is wrong (a slice outside its tensor, a file name that leaves the folder, ...).
    """
    path = folder / METADATA_FILE
    try:
        size = os.stat(path).st_size
        if size > MAX_METADATA_BYTES:
            _bad(path, "its size", size, f"at most {MAX_METADATA_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(
            f"{str(path)!r}, DCP's index of the checkpoint, is missing or unreadable ({exc.strerror or exc}): "
            f"the folder is not a complete DCP checkpoint. {_FIX}"
        ) from exc
    try:
        found = _IndexUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # a damaged pickle raises anything: EOFError, UnpicklingError, TypeError, ...
        raise CheckpointError(
            f"{str(path)!r} is not a readable DCP index ({type(exc).__name__}: {str(exc)[:200]}); the checkpoint "
            f"is damaged. {_FIX}"
        ) from exc
    _check_metadata(path, found)
    return found  # type: ignore[no-any-return]


def _check_metadata(path: Path, md: Any) -> None:
    if type(md) is not dcp_metadata.Metadata:
        _bad(path, "the index", type(md).__name__, "a torch.distributed.checkpoint Metadata")
    entries = md.state_dict_metadata
    if not isinstance(entries, dict):
        _bad(path, "'state_dict_metadata'", type(entries).__name__, "a dict")
    for key, entry in entries.items():
        if not isinstance(key, str):
            _bad(path, "a key", key, "a string")
        if type(entry) is dcp_metadata.TensorStorageMetadata:
            _check_tensor_entry(path, key, entry)
        elif type(entry) is not dcp_metadata.BytesStorageMetadata:
            _bad(path, f"the entry of {key!r}", type(entry).__name__, "tensor or bytes storage metadata")
    storage = md.storage_data
    if not isinstance(storage, dict):
        _bad(path, "'storage_data'", type(storage).__name__, "a dict from each item to its place in a file")
    for index, info in storage.items():
        if type(index) is not dcp_metadata.MetadataIndex or type(info) is not dcp_filesystem._StorageInfo:
            _bad(path, "a storage entry", (type(index).__name__, type(info).__name__), "(MetadataIndex, _StorageInfo)")
        name = info.relative_path
        if not (isinstance(name, str) and _DATA_NAME.fullmatch(name)):
            _bad(path, f"the file of {index.fqn!r}", name, "a plain file name inside the folder")
        if not all(type(x) is int and 0 <= x <= 1 << 62 for x in (info.offset, info.length)):
            _bad(path, f"the place of {index.fqn!r}", (info.offset, info.length), "non-negative int offset and length")
        if info.transform_descriptors:
            _bad(path, f"the transforms of {index.fqn!r}", info.transform_descriptors, "none (multigpu writes none)")


def _check_tensor_entry(path: Path, key: str, entry: Any) -> None:
    size, props = entry.size, entry.properties
    if type(size) is not torch.Size or not all(type(n) is int and 0 <= n <= 1 << 62 for n in size):
        _bad(path, f"the shape of {key!r}", size, "a torch.Size of non-negative ints")
    if type(props) is not dcp_metadata.TensorProperties or not isinstance(props.dtype, torch.dtype):
        _bad(path, f"the properties of {key!r}", props, "TensorProperties with a dtype")
    if not isinstance(entry.chunks, list):
        _bad(path, f"the slices of {key!r}", type(entry.chunks).__name__, "a list")
    for chunk in entry.chunks:
        ok = type(chunk) is dcp_metadata.ChunkStorageMetadata and all(
            type(t) is torch.Size and len(t) == len(size) for t in (chunk.offsets, chunk.sizes)
        )
        if not ok or any(o < 0 or n < 0 or o + n > dim for o, n, dim in zip(chunk.offsets, chunk.sizes, size)):
            _bad(path, f"a slice of {key!r}", chunk, f"a slice inside its shape {tuple(size)}")


# --- the files themselves -----------------------------------------------------------------------


def check_files(
    folder: Path,
    metadata: dcp_metadata.Metadata,
    manifest: Manifest | None,
    *,
    rank: int = 0,
    world_size: int = 1,
    crc: bool = True,
) -> None:
    """Every file the index names is there with its recorded size, every slice inside it; CRC-32s match.

    Each file's CRC-32 is checked by one rank (files ``i``, ``i + world_size``, ... by rank ``i``),
    so every byte is read once whatever the world size; sizes are checked by every rank. Without a
    manifest (a DCP folder written elsewhere) only the slices are checked against the file sizes;
    ``crc=False`` checks sizes only (reads no data).

    Raises:
        CheckpointError: naming the first file that is missing, of the wrong size, or damaged.
    """
    sizes: dict[str, int] = {}
    names = sorted(manifest.files) if manifest else sorted({i.relative_path for i in metadata.storage_data.values()})
    for name in names:
        path = folder / name
        try:
            sizes[name] = os.stat(path).st_size
        except OSError as exc:
            raise CheckpointError(
                f"{str(path)!r}, a file of the sharded checkpoint, is missing or unreadable ({exc.strerror or exc}). {_FIX}"
            ) from exc
        record = manifest.files[name] if manifest else None
        if record is not None and sizes[name] != record.nbytes:
            raise CheckpointError(
                f"{str(path)!r} has {sizes[name]} bytes; the manifest records {record.nbytes} (the file was "
                f"truncated or replaced). {_FIX}"
            )
    for index, info in metadata.storage_data.items():
        if info.relative_path not in sizes:
            raise CheckpointError(
                f"{str(folder / METADATA_FILE)!r} places {index.fqn!r} in {info.relative_path!r}, which the "
                f"manifest does not list. {_FIX}"
            )
        if info.offset + info.length > sizes[info.relative_path]:
            raise CheckpointError(
                f"{str(folder / info.relative_path)!r} has {sizes[info.relative_path]} bytes, but {index.fqn!r} "
                f"lies at bytes {info.offset}..{info.offset + info.length} (the file was truncated). {_FIX}"
            )
    if manifest is None or not crc:
        return
    for name in names[rank::world_size]:
        if file_crc32(folder / name).crc32 != manifest.files[name].crc32:
            raise CheckpointError(
                f"{str(folder / name)!r} does not match the CRC-32 its manifest records: its bytes were changed "
                f"after the save (a damaged disk or copy). {_FIX}"
            )
