"""DCP's index of a sharded checkpoint folder, and the checks made before anything reads the folder.

A :class:`~multigpu.checkpoint.state.Checkpointer` saving a model sharded by fsdp writes its step
folder with ``torch.distributed.checkpoint`` (DCP), so no process ever holds the whole model:

    step-00000042/
      .metadata        DCP's index: each tensor's global shape and dtype, where each slice lies (rank 0)
      __0_0.distcp     rank 0's slices of the weights and optimizer state; __1_0.distcp rank 1's, ...
      state.pt         step, epoch, every rank's random state, scheduler, scaler, data position (as unsharded)
      manifest.json    the marker, with every DCP file's size and CRC-32 (:mod:`folders`)

The folder is itself a DCP checkpoint (``torch.distributed.checkpoint.load`` reads it). Before DCP
reads a folder, multigpu checks it: ``.metadata`` (a pickle) unpickled with only the classes DCP's
index is made of, so it runs no code, then its fields; every file present with its recorded size;
every slice inside its file; every file's CRC-32. A failed check is a
:class:`~multigpu.errors.CheckpointError` naming the file and the fix.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from multigpu.checkpoint.folders import (
    DATA_NAME,
    FIX,
    METADATA_FILE,
    Manifest,
    bad,
    file_crc32,
    is_sharded_folder,
)
from multigpu.errors import CheckpointError

MAX_METADATA_BYTES = 256 << 20  # an index of millions of tensors stays far below


def is_dcp_folder(path: Path) -> bool:
    """Whether ``path`` is a folder holding a DCP checkpoint (DCP's index, or a sharded checkpoint's manifest)."""
    return path.is_dir() and ((path / METADATA_FILE).is_file() or is_sharded_folder(path))


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
            bad(path, "its size", size, f"at most {MAX_METADATA_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(
            f"{str(path)!r}, DCP's index of the checkpoint, is missing or unreadable ({exc.strerror or exc}): "
            f"the folder is not a complete DCP checkpoint. {FIX}"
        ) from exc
    try:
        found = _IndexUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # a damaged pickle raises anything: EOFError, UnpicklingError, TypeError, ...
        raise CheckpointError(
            f"{str(path)!r} is not a readable DCP index ({type(exc).__name__}: {str(exc)[:200]}); the checkpoint "
            f"is damaged. {FIX}"
        ) from exc
    _check_metadata(path, found)
    return found  # type: ignore[no-any-return]


def _check_metadata(path: Path, md: Any) -> None:
    if type(md) is not dcp_metadata.Metadata:
        bad(path, "the index", type(md).__name__, "a torch.distributed.checkpoint Metadata")
    entries = md.state_dict_metadata
    if not isinstance(entries, dict):
        bad(path, "'state_dict_metadata'", type(entries).__name__, "a dict")
    for key, entry in entries.items():
        if not isinstance(key, str):
            bad(path, "a key", key, "a string")
        if type(entry) is dcp_metadata.TensorStorageMetadata:
            _check_tensor_entry(path, key, entry)
        elif type(entry) is not dcp_metadata.BytesStorageMetadata:
            bad(path, f"the entry of {key!r}", type(entry).__name__, "tensor or bytes storage metadata")
    storage = md.storage_data
    if not isinstance(storage, dict):
        bad(path, "'storage_data'", type(storage).__name__, "a dict from each item to its place in a file")
    for index, info in storage.items():
        if type(index) is not dcp_metadata.MetadataIndex or type(info) is not dcp_filesystem._StorageInfo:
            bad(path, "a storage entry", (type(index).__name__, type(info).__name__), "(MetadataIndex, _StorageInfo)")
        name = info.relative_path
        if not (isinstance(name, str) and DATA_NAME.fullmatch(name)):
            bad(path, f"the file of {index.fqn!r}", name, "a plain file name inside the folder")
        if not all(type(x) is int and 0 <= x <= 1 << 62 for x in (info.offset, info.length)):
            bad(path, f"the place of {index.fqn!r}", (info.offset, info.length), "non-negative int offset and length")
        if info.transform_descriptors:
            bad(path, f"the transforms of {index.fqn!r}", info.transform_descriptors, "none (multigpu writes none)")


def _check_tensor_entry(path: Path, key: str, entry: Any) -> None:
    size, props = entry.size, entry.properties
    if type(size) is not torch.Size or not all(type(n) is int and 0 <= n <= 1 << 62 for n in size):
        bad(path, f"the shape of {key!r}", size, "a torch.Size of non-negative ints")
    if type(props) is not dcp_metadata.TensorProperties or not isinstance(props.dtype, torch.dtype):
        bad(path, f"the properties of {key!r}", props, "TensorProperties with a dtype")
    if not isinstance(entry.chunks, list):
        bad(path, f"the slices of {key!r}", type(entry.chunks).__name__, "a list")
    for chunk in entry.chunks:
        ok = type(chunk) is dcp_metadata.ChunkStorageMetadata and all(
            type(t) is torch.Size and len(t) == len(size) for t in (chunk.offsets, chunk.sizes)
        )
        if not ok or any(o < 0 or n < 0 or o + n > dim for o, n, dim in zip(chunk.offsets, chunk.sizes, size)):
            bad(path, f"a slice of {key!r}", chunk, f"a slice inside its shape {tuple(size)}")


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
                f"{str(path)!r}, a file of the sharded checkpoint, is missing or unreadable ({exc.strerror or exc}). {FIX}"
            ) from exc
        record = manifest.files[name] if manifest else None
        if record is not None and sizes[name] != record.nbytes:
            raise CheckpointError(
                f"{str(path)!r} has {sizes[name]} bytes; the manifest records {record.nbytes} (the file was "
                f"truncated or replaced). {FIX}"
            )
    for index, info in metadata.storage_data.items():
        if info.relative_path not in sizes:
            raise CheckpointError(
                f"{str(folder / METADATA_FILE)!r} places {index.fqn!r} in {info.relative_path!r}, which the "
                f"manifest does not list. {FIX}"
            )
        if info.offset + info.length > sizes[info.relative_path]:
            raise CheckpointError(
                f"{str(folder / info.relative_path)!r} has {sizes[info.relative_path]} bytes, but {index.fqn!r} "
                f"lies at bytes {info.offset}..{info.offset + info.length} (the file was truncated). {FIX}"
            )
    if manifest is None or not crc:
        return
    for name in names[rank::world_size]:
        if file_crc32(folder / name).crc32 != manifest.files[name].crc32:
            raise CheckpointError(
                f"{str(folder / name)!r} does not match the CRC-32 its manifest records: its bytes were changed "
                f"after the save (a damaged disk or copy). {FIX}"
            )
