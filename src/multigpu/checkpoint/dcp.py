"""The sharded storage of a step folder (fsdp): every rank writes and reads its own slices with DCP.

What DCP saves is ``{"model": ..., "optimizer": ...}`` from torch's ``get_state_dict`` (the bare
model's keys; under fsdp this rank's slices, DTensors; the optimizer flattened to one entry per
value). Save: every rank writes its files into the temporary folder and reads them back for their CRC-32s;
rank 0 writes the index, ``manifest.json`` (each file's size and CRC-32, :mod:`manifest`) and ``state.pt``. Resume: every
check (state, manifest, index, files, names and shapes against the live objects) runs on every
rank and the ranks agree before DCP reads anything, so a damaged checkpoint fails every rank
with the same error; then each rank's slices are read into fresh tensors, and only then applied.

The folder is read without running code: ``.metadata`` (DCP's index, a pickle) is unpickled with
only the classes an index is made of, then checked field by field; every file the manifest lists
must be there with its recorded size and CRC-32, every slice inside its file. DCP then reads with
the checked index, and non-tensor values load with ``weights_only=True``. The layout is in
docs/checkpoints.md. A failed check is a :class:`~multigpu.errors.CheckpointError` naming the file
and the fix.
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
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, NoReturn, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from multigpu.checkpoint.atomic import FIX, STATE_FILE, explain_os_errors, files_bytes, regular_files
from multigpu.checkpoint.file_kinds import open_regular
from multigpu.checkpoint.formats import Structure, check_total
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
    write_manifest,
)
from multigpu.checkpoint.ranks import Staging, agreed, thread_group
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.checkpoint.validate import Refusal, TrainingState
from multigpu.core.keys import describe_mismatch, unwrap
from multigpu.devices import get_device_type
from multigpu.errors import CheckpointError, MultigpuError
from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.world import global_rank, world_size

METADATA_FILE = ".metadata"  # DCP's name for its index
FORMAT = "dcp"
_SHARD_NAME = re.compile(r"__([0-9]{1,8})_[0-9]{1,8}\.distcp", re.ASCII)
DATA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}", re.ASCII)  # a plain name inside the folder
MAX_METADATA_BYTES = 256 << 20  # an index of millions of tensors stays far below
MODEL = "model"  # the part of a Checkpointer's DCP state that holds the model (beside "optimizer")
OPTIMIZER = "optimizer"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_NO_GROUP = "torch.distributed is disabled, unavailable or uninitialized"
# What DCP raises: its CheckpointException (every rank's failures, gathered) derives from BaseException.
DCP_FAILURES = (Exception, CheckpointException)
T = TypeVar("T")


def own_files(folder: Path, rank: int) -> dict[str, FileRecord]:
    """The DCP files rank ``rank`` wrote into ``folder`` (``__<rank>_*.distcp``; rank 0 also ``.metadata``)."""
    names = [p.name for p in folder.iterdir() if (m := _SHARD_NAME.fullmatch(p.name)) and int(m.group(1)) == rank]
    if rank == 0 and (folder / METADATA_FILE).is_file():
        names.append(METADATA_FILE)
    return {name: file_record(folder / name) for name in sorted(names)}


def read_dcp_manifest(folder: Path) -> Manifest:
    """The checked manifest of the sharded checkpoint ``folder`` (:func:`~multigpu.checkpoint.manifest.read_manifest`)."""
    return read_manifest(folder, format=FORMAT, required=METADATA_FILE)


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

    The keys are the model's own (DCP's ``model.`` prefix removed); a checkpoint written by another
    tool without a ``model`` part gives all its tensors. Needs memory for the whole model.

    Raises:
        CheckpointError: the folder is damaged (:func:`check_files`), or its
            tensors would take more than ``max_expansion`` times its files' bytes.
    """
    metadata, _ = checked_index(folder)
    entries = model_entries(metadata)
    sizes = {key: math.prod(e.size) * e.properties.dtype.itemsize for key, (_, e) in entries.items()}
    largest = max(sizes.items(), key=lambda item: item[1], default=("", 0))
    check_total(folder, files_bytes(folder), sum(sizes.values()), largest, max_expansion=max_expansion)
    # Keyed as in the index: DCP matches a flat key with dots to the same key in the file.
    try:
        plain = {fqn: torch.empty(tuple(e.size), dtype=e.properties.dtype) for fqn, e in entries.values()}
    except RuntimeError as exc:  # the allocator's refusal of shapes beyond this machine's memory
        raise CheckpointError(
            f"the tensors of {str(folder)!r} do not fit in memory here ({str(exc)[:200]}); its index declares "
            f"{sum(sizes.values())} bytes. Read it "
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


# --- DCP's state of a model and optimizer --------------------------------------------------------


def live_state(model: nn.Module, optimizer: Any | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """What DCP saves of ``model`` and ``optimizer``, and the optimizer's plain state when it has none yet.

    Returns:
        ``({"model": ..., "optimizer": ...}, None)``; or, for an optimizer that has not stepped yet,
        ``({"model": ...}, optimizer.state_dict())``: its param groups only, which go into ``state.pt``.
        torch's ``get_state_dict`` would first initialize an empty optimizer state with a step of
        learning rate 0 (Adam's step counter becomes 1), and the resumed run would then differ.

    Does not communicate.
    """
    bare = unwrap(model)
    if optimizer is None:
        return {MODEL: get_model_state_dict(bare, options=_OPTIONS)}, None
    if not optimizer.state:
        return {MODEL: get_model_state_dict(bare, options=_OPTIONS)}, optimizer.state_dict()
    weights, optimizer_state = get_state_dict(bare, optimizer, options=_OPTIONS)
    return {MODEL: weights, OPTIMIZER: optimizer_state}, None


def load_target(model: nn.Module, optimizer: Any | None) -> dict[str, Any]:
    """Empty tensors shaped like ``model``'s (and ``optimizer``'s) state, sliced like them, for DCP to fill.

    Loading fills these, not the model: nothing changes until :func:`apply_state`. An optimizer
    that has not stepped yet gets its state initialized first (torch's ``get_state_dict`` steps it
    with learning rate 0), so that it has buffers to load into.
    """
    bare = unwrap(model)
    state: dict[str, Mapping[str, Any]] = {}
    if optimizer is None:
        state[MODEL] = get_model_state_dict(bare, options=_OPTIONS)
    else:
        state[MODEL], state[OPTIMIZER] = get_state_dict(bare, optimizer, options=_OPTIONS)
    return {part: {k: _empty_like(v) for k, v in values.items()} for part, values in state.items()}


def _empty_like(value: Any) -> Any:
    return torch.empty_like(value) if isinstance(value, torch.Tensor) else value


def apply_state(model: nn.Module, optimizer: Any | None, loaded: dict[str, Any]) -> None:
    """Copy what DCP loaded into ``model`` and ``optimizer`` (torch's ``set_state_dict``)."""
    bare = unwrap(model)
    if OPTIMIZER in loaded and optimizer is not None:
        set_state_dict(
            bare, optimizer, model_state_dict=loaded[MODEL], optim_state_dict=loaded[OPTIMIZER], options=_OPTIONS
        )
    else:
        set_model_state_dict(bare, loaded[MODEL], options=_OPTIONS)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, raising the ``OSError`` behind a short write of a tensor as itself.

    DCP writes each tensor with ``torch.save``, which reports a write past a file-size limit or onto a full
    disk as ``RuntimeError: ... unexpected pos``, the ``OSError`` only its context; the context does not
    travel when DCP gathers the ranks' failures, so no rank could tell the cause.
    """

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)  # (one thread: a failure is raised here)
        except RuntimeError as exc:
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from exc
            raise


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


# --- the storage ---------------------------------------------------------------------------------


class Sharded:
    """DCP's files and ``manifest.json`` beside ``state.pt``: see the module docstring.

    Args:
        model, optimizer: the live objects saved from or resumed into.
        folder: the step folder being resumed (names it in errors of the ranks' agreement).
    """

    name: ClassVar[str] = FORMAT
    files: ClassVar[tuple[str, ...]] = (METADATA_FILE, MANIFEST_FILE)
    collective: ClassVar[bool] = True

    # --- the folder ---

    @classmethod
    def serves(cls, model: nn.Module) -> bool:
        return any(isinstance(p, DTensor) for p in unwrap(model).parameters())  # sharded by fsdp

    @classmethod
    def holds(cls, folder: Path) -> bool:
        # Any entry of that name counts (a pipe, a folder, a dangling link): reading it then says what is wrong.
        # (Not the manifest's name: a one-file folder holds one too.)
        return os.path.lexists(folder / METADATA_FILE)

    @classmethod
    def is_complete(cls, folder: Path) -> bool:
        return regular_files(folder, (*cls.files, STATE_FILE))

    @classmethod
    def recorded_step(cls, folder: Path) -> int | None:
        try:
            return read_dcp_manifest(folder).step
        except (CheckpointError, OSError):
            return None

    @classmethod
    def describe(
        cls, folder: Path, *, allow_unsafe_pickle: bool
    ) -> tuple[Path, str, int, Structure, dict[str, str], dict[str, Any]]:
        index, _ = checked_index(folder, crc=False)  # sizes only: inspect reads no data
        structure = [(key, tuple(e.size), e.properties.dtype) for key, (_, e) in model_entries(index).items()]
        facts: dict[str, Any] = {"shard files": len({i.relative_path for i in index.storage_data.values()})}
        if any(k.startswith(f"{OPTIMIZER}.") for k in index.state_dict_metadata):
            facts["optimizer"] = True  # in the shards (state.pt holds it only before its first step)
        return folder, cls.name, files_bytes(folder), structure, {}, facts

    @classmethod
    def read_weights(
        cls, folder: Path, *, allow_unsafe_pickle: bool, max_expansion: float
    ) -> tuple[Mapping[str, torch.Tensor], dict[str, str]]:
        step = cls.recorded_step(folder)  # a DCP folder written elsewhere has none
        return read_sharded_weights(folder, max_expansion=max_expansion), {} if step is None else {"step": str(step)}

    def __init__(self, model: nn.Module, optimizer: Any | None, *, folder: Path | None = None) -> None:
        self.model, self.optimizer, self.folder = model, optimizer, folder
        self._target: dict[str, Any] = {}
        self._metadata: Metadata | None = None
        # What an optimizer that has not stepped yet looks like: loading targets initialize its state.
        self._fresh = None if optimizer is None or optimizer.state else optimizer.state_dict()
        self._shards: dict[str, Any] = {}
        self._plain: dict[str, Any] | None = None
        self._staged = False  # a snapshot (staged()): writes what was copied then

    # --- save ---

    def saved_optimizer(self) -> dict[str, Any] | None:
        if not self._staged:  # what DCP writes is taken here, once, on every rank (it does not communicate)
            self._shards, self._plain = live_state(self.model, self.optimizer)
        return self._plain

    def staged(self, staging: Staging) -> Sharded:
        """This rank's shards copied into host memory by DCP's stager, the rest through ``staging``.

        DCP's ``DefaultStager`` (what ``torch.distributed.checkpoint.async_save`` stages with) keeps one host
        copy per source storage, weakly keyed, pinned where the device wants it; kept in ``staging`` between
        saves, it copies into the same memory again. ``async_save`` itself is not called: its thread would
        write into a folder the protocol creates only on the write's side (under the folder's lock), and the
        sealing, rename and agreement of the ranks come after DCP's write on the same thread.
        """
        shards, plain = live_state(self.model, self.optimizer)
        stager = staging.kept.get(self.name)
        if stager is None:
            local = [v.to_local() if isinstance(v, DTensor) else v for part in shards.values() for v in part.values()]
            devices = {t.device for t in local if isinstance(t, torch.Tensor) and t.device.type != "cpu"}
            pin = any(get_device_type(d).pin_memory for d in devices)
            stager = staging.kept[self.name] = DefaultStager(StagingOptions(pin, False, False, False))  # synchronous
        snapshot = Sharded(self.model, None)
        copied = stager.stage(shards)  # synchronous staging: the copy, not a future of it
        snapshot._shards = copied if isinstance(copied, dict) else copied.result()
        snapshot._plain, snapshot._staged = staging.copy(plain), True
        return snapshot

    def write(self, tmp: Path, target: Path, step: int) -> dict[str, FileRecord] | str:
        # Each rank its slices, rank 0 the index; DCP's collectives go over this thread's checkpoint group
        # (ranks.thread_group). Every file is flushed and fsynced.
        writer = _Writer(tmp, sync_files=True)
        try:
            with explain_collective_failures(f"writing the shards of checkpoint {target}"):
                if (
                    _grouped()
                ):  # (no warnings filter: catch_warnings is not thread-safe; this may run in the background)
                    dcp.save(self._shards, storage_writer=writer, process_group=thread_group())
                else:
                    with _quiet():
                        dcp.save(self._shards, storage_writer=writer, no_dist=True)
        except MultigpuError:
            raise  # already explained (a collective timed out, a peer exited, ...)
        except DCP_FAILURES as exc:  # DCP gathers every rank's failure into one exception
            _raise_write_failure(target, exc)
        # A failure is sent to rank 0 as text rather than raised here, where rank 0 would wait for it.
        try:
            return own_files(tmp, global_rank())
        except OSError as exc:
            return f"rank {global_rank()} could not read back its files in {str(tmp)!r}: {exc}"

    def seal(self, tmp: Path, written: list[Any], step: int, world_size: int) -> str:
        failed = [r for r in written if isinstance(r, str)]
        if failed:
            raise CheckpointError(f"{failed[0]}. The previous checkpoint is unchanged.")
        files = {name: record for per_rank in written for name, record in per_rank.items()}
        return write_manifest(tmp, format=self.name, step=step, world_size=world_size, files=files)

    # --- resume ---

    def read(self, locate: Callable[[], Path | None], *, allow_unsafe_pickle: bool) -> tuple[Path, Any] | None:
        folder = locate()
        if folder is None:
            return None
        state_file = folder / STATE_FILE
        try:
            return folder, load_torch_file(state_file, allow_unsafe_pickle=allow_unsafe_pickle)
        except OSError as exc:  # missing, a folder, a pipe, unreadable
            raise CheckpointError(
                f"{str(state_file)!r} is missing or unreadable ({exc.strerror or exc}): {str(folder)!r} is not a "
                "complete checkpoint folder. Resume from another step (Checkpointer.resume(path=...)), or without "
                "path= to use the latest."
            ) from exc

    def check(self, folder: Path, checked: TrainingState) -> bool:
        manifest = read_dcp_manifest(folder)
        r = Refusal(folder / STATE_FILE)
        if manifest.step != checked.step:
            r.fail("entry 'step'", checked.step, f"{manifest.step}, the step its manifest.json records")
        if checked.model_checksum != manifest.digest:
            r.fail("its model checksum", checked.model_checksum, f"{manifest.digest}, the shards' in manifest.json")
        self._metadata = read_metadata(folder)
        check_files(folder, self._metadata, manifest, rank=global_rank(), world_size=world_size())
        in_shards = any(k.startswith(f"{OPTIMIZER}.") for k in self._metadata.state_dict_metadata)
        self._target = load_target(self.model, self.optimizer if in_shards else None)
        _check_shapes(folder, self._metadata, self._target, self.model)
        return in_shards

    def load(self, folder: Path, *, allow_unsafe_pickle: bool) -> None:
        if self._metadata is None:
            raise CheckpointError(f"{str(folder)!r} was not checked before it was read (a bug in multigpu).")
        try:
            with explain_collective_failures(f"reading checkpoint {folder}"):
                dcp_load(
                    folder,
                    self._target,
                    self._metadata,
                    no_dist=not _grouped(),
                    allow_unsafe_pickle=allow_unsafe_pickle,
                )
        except MultigpuError:
            raise  # a damaged value (CheckpointError), a collective that timed out, a peer that exited
        except DCP_FAILURES as exc:  # DCP wraps every rank's failure in a CheckpointException
            raise CheckpointError(
                f"reading the sharded checkpoint {str(folder)!r} failed ({describe_failure(exc)}). "
                "Resume from another step (Checkpointer.resume(path=...)) if it is damaged."
            ) from exc

    def apply(self) -> None:
        apply_state(self.model, self.optimizer if OPTIMIZER in self._target else None, self._target)

    def discard(self) -> None:
        if self.optimizer is not None and self._fresh is not None:
            self.optimizer.load_state_dict(self._fresh)  # as it was: no state

    def agreed(self, compute: Callable[[], T]) -> T:
        return agreed(compute, f"checking checkpoint {self.folder}")


def _raise_write_failure(target: Path, exc: BaseException) -> NoReturn:
    causes = failure_causes(exc)
    os_error = next((cause for _, cause in causes if isinstance(cause, OSError)), None)
    if os_error is not None:
        with explain_os_errors(target):  # a full disk, a size limit, an unwritable folder: explained
            raise os_error from exc
    raise CheckpointError(
        f"could not write the shards of checkpoint {str(target)!r} ({describe_failure(exc)}). "
        "The previous checkpoint is unchanged."
    ) from exc


def _check_shapes(folder: Path, metadata: Metadata, target: dict[str, Any], model: nn.Module) -> None:
    """The saved entries are exactly those ``target`` asks for, tensors with the same (whole) shapes."""
    saved = metadata.state_dict_metadata
    expected = flatten_state_dict(target)[0]  # DCP's keys: {"model": {"w": t}} -> "model.w"
    prefix = f"{MODEL}."
    model_saved = {
        k[len(prefix) :]: torch.empty(tuple(v.size), device="meta")
        for k, v in saved.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }
    model_live = {
        k[len(prefix) :]: v for k, v in expected.items() if k.startswith(prefix) and isinstance(v, torch.Tensor)
    }
    problem = describe_mismatch(model_live, model_saved)
    if problem:
        raise CheckpointError(
            f"the sharded checkpoint {str(folder)!r} does not match {type(unwrap(model)).__name__}: {problem}"
        )
    if OPTIMIZER not in target:
        return
    prefix = f"{OPTIMIZER}."
    live = {k for k in expected if k.startswith(prefix)}
    stored = {k for k in saved if k.startswith(prefix)}
    # Saved param-group options the live optimizer lacks (e.g. a scheduler's initial_lr) are not
    # loaded, as torch's set_state_dict does; saved per-parameter state must match exactly.
    unexpected = sorted(k for k in stored - live if not k.startswith(f"{prefix}param_groups."))
    wrong = sorted(k for k in live & stored if _shape_of(saved[k]) != _shape_of(expected[k]))
    if live - stored or unexpected or wrong:
        listed = "; ".join(
            f"{label}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
            for label, keys in (
                ("missing", sorted(live - stored)),
                ("unexpected", unexpected),
                ("shape or kind differs", wrong),
            )
            if keys
        )
        raise CheckpointError(
            f"the optimizer state in {str(folder)!r} does not fit the optimizer passed to resume ({listed}). "
            "Pass the optimizer the checkpoint was saved with (same class and parameter groups)."
        )


def _shape_of(value: Any) -> tuple[int, ...] | None:
    # A tensor's (whole) shape, None for a plain value: a tensor must meet a tensor of its shape.
    if isinstance(value, TensorStorageMetadata):
        return tuple(value.size)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None
