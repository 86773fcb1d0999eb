"""A DCP (torch.distributed.checkpoint) folder read without running code: its index, its files, its tensors.

Before DCP reads a folder, multigpu checks it: ``.metadata`` (a pickle) unpickled with only the
classes DCP's index is made of, then its fields; every file its manifest lists present with its
recorded size and CRC-32 (:mod:`manifest`); every slice inside its file. DCP then reads with the
checked index, and non-tensor values load with ``weights_only=True``. The layout of a sharded step
folder is in docs/checkpoints.md. A failed check is a :class:`~multigpu.errors.CheckpointError`
naming the file and the fix.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import re
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from multigpu.checkpoint.atomic import FIX
from multigpu.checkpoint.file_kinds import open_regular
from multigpu.checkpoint.formats import check_total
from multigpu.checkpoint.manifest import (
    MANIFEST_FILE,
    FileRecord,
    Manifest,
    bad,
    check_crcs,
    check_sizes,
    file_record,
    file_sizes,
    read_manifest,
)
from multigpu.errors import CheckpointError

METADATA_FILE = ".metadata"  # DCP's name for its index
FORMAT = "dcp"
_SHARD_NAME = re.compile(r"__([0-9]{1,8})_[0-9]{1,8}\.distcp", re.ASCII)
DATA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}", re.ASCII)  # a plain name inside the folder
MAX_METADATA_BYTES = 256 << 20  # an index of millions of tensors stays far below
MODEL = "model"  # the part of a Checkpointer's DCP state that holds the model (beside "optimizer")
_NO_GROUP = "torch.distributed is disabled, unavailable or uninitialized"
# What DCP raises: its CheckpointException (every rank's failures, gathered) derives from BaseException.
DCP_FAILURES = (Exception, CheckpointException)


def own_files(folder: Path, rank: int) -> dict[str, FileRecord]:
    """The DCP files rank ``rank`` wrote into ``folder`` (``__<rank>_*.distcp``; rank 0 also ``.metadata``)."""
    names = [p.name for p in folder.iterdir() if (m := _SHARD_NAME.fullmatch(p.name)) and int(m.group(1)) == rank]
    if rank == 0 and (folder / METADATA_FILE).is_file():
        names.append(METADATA_FILE)
    return {name: file_record(folder / name) for name in sorted(names)}


def read_dcp_manifest(folder: Path) -> Manifest:
    """The checked manifest of the sharded checkpoint ``folder`` (:func:`~multigpu.checkpoint.manifest.read_manifest`)."""
    return read_manifest(folder, format=FORMAT, required=METADATA_FILE)


def recorded_step(folder: Path) -> int | None:
    """The step the manifest of ``folder`` records, or ``None`` if it has no readable manifest."""
    try:
        return read_dcp_manifest(folder).step
    except (CheckpointError, OSError):
        return None


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
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_METADATA_BYTES:
                bad(path, "its size", size, f"at most {MAX_METADATA_BYTES} bytes")
            raw = f.read()
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
    if md.storage_meta is not None and type(md.storage_meta) is not dcp_metadata.StorageMeta:
        bad(path, "'storage_meta'", type(md.storage_meta).__name__, "None or a StorageMeta")
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
    # DCP stores every element once: slices that do not add up to the tensor leave part of it unread
    # (it would load as uninitialised memory), or declare a shape far beyond the files' bytes.
    stored = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
    if stored != math.prod(size):
        bad(
            path,
            f"the slices of {key!r}",
            f"{len(entry.chunks)} slices of {stored} elements",
            f"slices covering its {math.prod(size)} elements (shape {tuple(size)})",
        )


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
    """Every file the manifest lists is there with its recorded size, every slice inside its file; CRC-32s match.

    Each file's CRC-32 is checked by one rank (files ``i``, ``i + world_size``, ... by rank ``i``),
    so every byte is read once whatever the world size; sizes are checked by every rank. Without a
    manifest (a DCP folder written elsewhere) only the slices are checked against the file sizes;
    ``crc=False`` checks sizes only (reads no data).

    Raises:
        CheckpointError: naming the first file that is missing, of the wrong size, or damaged.
    """
    if manifest is not None:
        sizes = check_sizes(folder, manifest)
    else:
        sizes = file_sizes(folder, sorted({i.relative_path for i in metadata.storage_data.values()}))
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
    if manifest is not None and crc:
        check_crcs(folder, manifest, sorted(manifest.files)[rank::world_size])


# --- reading the tensors -----------------------------------------------------------------------


def checked_index(folder: Path, *, crc: bool = True) -> tuple[dcp_metadata.Metadata, Manifest | None]:
    """DCP's index of ``folder`` and its manifest (``None``: a DCP folder written elsewhere), the files checked.

    ``crc=False`` checks the files' sizes only (reads no data), as :func:`check_files` does.
    """
    index = read_metadata(folder)
    manifest = read_dcp_manifest(folder) if os.path.lexists(folder / MANIFEST_FILE) else None
    check_files(folder, index, manifest, crc=crc)
    return index, manifest


def read_sharded_weights(folder: Path, *, max_expansion: float = math.inf) -> OrderedDict[str, torch.Tensor]:
    """The model's whole tensors from the DCP checkpoint ``folder``, checked first, read by this process alone.

    Raises:
        CheckpointError: the folder is damaged (:func:`check_files`), or its
            tensors would take more than ``max_expansion`` times its files' bytes.
    """
    index, _ = checked_index(folder)
    sizes = {key: math.prod(e.size) * e.properties.dtype.itemsize for key, (_, e) in model_entries(index).items()}
    largest = max(sizes.items(), key=lambda item: item[1], default=("", 0))
    check_total(folder, files_bytes(folder), sum(sizes.values()), largest, max_expansion=max_expansion)
    return read_model_tensors(folder, index)


def files_bytes(folder: Path) -> int:
    """The bytes of the regular files directly in ``folder``."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.is_symlink())


def read_model_tensors(folder: Path, metadata: Metadata) -> OrderedDict[str, torch.Tensor]:
    """The model's whole tensors from the DCP checkpoint in ``folder``, read by this process alone.

    The keys are the model's own (DCP's ``model.`` prefix removed); a checkpoint written by another
    tool without a ``model`` part gives all its tensors. Needs memory for the whole model.
    """
    entries = model_entries(metadata)
    # Keyed as in the index: DCP matches a flat key with dots to the same key in the file.
    try:
        plain = {fqn: torch.empty(tuple(e.size), dtype=e.properties.dtype) for fqn, e in entries.values()}
    except RuntimeError as exc:  # the allocator's refusal of shapes beyond this machine's memory
        raise CheckpointError(
            f"the tensors of {str(folder)!r} do not fit in memory here ({str(exc)[:200]}); its index declares "
            f"{sum(math.prod(e.size) * e.properties.dtype.itemsize for _, e in entries.values())} bytes. Read it "
            "on a machine with that much memory, or check that it is the checkpoint you meant."
        ) from exc
    try:
        dcp_load(folder, plain, metadata, no_dist=True)
    except CheckpointError:
        raise
    except DCP_FAILURES as exc:
        raise CheckpointError(
            f"reading the tensors of {str(folder)!r} failed ({describe_failure(exc)}); the folder is damaged."
        ) from exc
    return OrderedDict((key, plain[fqn]) for key, (fqn, _) in entries.items())


def dcp_load(
    folder: Path, target: dict[str, Any], metadata: Metadata, *, no_dist: bool, allow_unsafe_pickle: bool = False
) -> None:
    """``dcp.load`` into ``target`` with the index as :func:`read_metadata` checked it; values weights-only.

    Check the folder first (:func:`check_files`). With a process group (``no_dist=False``) every
    rank must call it: DCP plans the reads together.
    """
    planner = DefaultLoadPlanner() if allow_unsafe_pickle else _PlainValuesPlanner()
    with _quiet():
        dcp.load(target, storage_reader=_CheckedReader(folder, metadata), planner=planner, no_dist=no_dist)


def model_entries(metadata: Metadata) -> dict[str, tuple[str, TensorStorageMetadata]]:
    """The model's tensors in a DCP index: ``{model key: (key in the index, its entry)}``."""
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    prefix = f"{MODEL}."
    if any(k.startswith(prefix) for k in tensors):
        return {k[len(prefix) :]: (k, v) for k, v in tensors.items() if k.startswith(prefix)}
    return {k: (k, v) for k, v in tensors.items()}


class _CheckedReader(dcp.FileSystemReader):
    """DCP's file reader, given the index already read safely: DCP's own reader would ``pickle.load`` it."""

    def __init__(self, folder: Path, metadata: Metadata) -> None:
        super().__init__(folder)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return self._metadata


class _PlainValuesPlanner(DefaultLoadPlanner):
    """DCP's planner, except that non-tensor values load with ``weights_only=True`` (numbers, strings, tuples)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:  # UnpicklingError for a forbidden global; anything for damaged bytes
            raise CheckpointError(
                f"the value {fqn!r} of the sharded checkpoint is not plain data ({type(exc).__name__}: "
                f"{str(exc)[:200]}); checkpoints multigpu writes hold only tensors, numbers and strings."
            ) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def failure_causes(exc: BaseException) -> list[tuple[int | None, BaseException]]:
    """The exceptions behind a DCP failure, with the rank each happened on (``None``: this process)."""
    if isinstance(exc, CheckpointException):
        return [(rank, wrapped[0]) for rank, wrapped in sorted(exc.failures.items())]
    return [(None, exc)]


def describe_failure(exc: BaseException) -> str:
    """One line per cause of a DCP failure, instead of DCP's tracebacks of every rank."""
    return "; ".join(
        ("" if rank is None else f"rank {rank}: ") + f"{type(cause).__name__}: {str(cause)[:300]}"
        for rank, cause in failure_causes(exc)[:4]
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # DCP warns whenever it runs without a process group; reading alone is what is meant here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_GROUP)
        yield
