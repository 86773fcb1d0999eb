"""Model and optimizer shards through torch.distributed.checkpoint (DCP), read without running code.

What goes in: ``{"model": ..., "optimizer": ...}`` from torch's ``get_state_dict`` (keys are the
bare model's own names; under fsdp the values are this rank's slices, DTensors; the optimizer's
state flattened to one entry per value, ``state.<param>.exp_avg``, ``param_groups.<param>.lr``).
DCP then saves each rank's slices into its own file and loads them back at any world size,
resharding as needed, into sharded or whole tensors.

Reading is made safe: DCP unpickles non-tensor values (an optimizer's ``lr``, ``betas``) with
``torch.load(weights_only=False)``; here they are loaded with ``weights_only=True``, and the files
are checked before DCP reads them (:mod:`dcp_files`).
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from multigpu.checkpoint.dcp_files import check_files, read_metadata
from multigpu.checkpoint.folders import is_sharded_folder, read_manifest
from multigpu.checkpoint.formats import check_total
from multigpu.core.keys import unwrap
from multigpu.errors import CheckpointError, MultigpuError
from multigpu.runtime.collective_failures import explain_collective_failures

MODEL = "model"
OPTIMIZER = "optimizer"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_NO_GROUP = "torch.distributed is disabled, unavailable or uninitialized"
# What DCP raises: its CheckpointException (every rank's failures, gathered) derives from BaseException.
DCP_FAILURES = (Exception, CheckpointException)


def is_sharded_model(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` (wrapped or not) is a DTensor, i.e. sharded by fsdp."""
    return any(isinstance(p, DTensor) for p in unwrap(model).parameters())


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


def flat_keys(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` flattened with DCP's own rule (``{"model": {"w": t}}`` -> ``{"model.w": t}``)."""
    return flatten_state_dict(state)[0]


def write_shards(folder: Path, state: dict[str, Any]) -> None:
    """Save ``state`` into ``folder`` with DCP: each rank its slices, rank 0 the index.

    Every rank of the process group must call it. Every file is flushed and ``fsync``ed.
    """
    with _quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), no_dist=not _grouped())


def read_shards(folder: Path, target: dict[str, Any], metadata: Metadata, *, allow_unsafe_pickle: bool = False) -> None:
    """Fill ``target`` (from :func:`load_target`) from the DCP checkpoint in ``folder``.

    Under a process group every rank must call it (DCP plans the reads together); without one it
    reads alone. ``metadata`` is the folder's index as :func:`~multigpu.checkpoint.dcp_files.read_metadata`
    read it: DCP is given it instead of unpickling the file itself. Check the folder first
    (:func:`~multigpu.checkpoint.dcp_files.check_files`).

    Raises:
        CheckpointError: DCP failed to read (the message names the folder and DCP's reason).
    """
    planner = DefaultLoadPlanner() if allow_unsafe_pickle else _PlainValuesPlanner()
    try:
        with _quiet(), explain_collective_failures(f"reading checkpoint {folder}"):
            dcp.load(target, storage_reader=_CheckedReader(folder, metadata), planner=planner, no_dist=not _grouped())
    except MultigpuError:
        raise  # a damaged value (CheckpointError), a collective that timed out, a peer that exited
    except DCP_FAILURES as exc:  # DCP wraps every rank's failure in a CheckpointException
        raise CheckpointError(
            f"reading the sharded checkpoint {str(folder)!r} failed ({describe_failure(exc)}). "
            "Resume from another step (Checkpointer.resume(path=...)) if it is damaged."
        ) from exc


def read_sharded_weights(folder: Path, *, max_expansion: float = math.inf) -> OrderedDict[str, torch.Tensor]:
    """The model's whole tensors from the DCP checkpoint ``folder``, checked first, read by this process alone.

    Raises:
        CheckpointError: the folder is damaged (:func:`~multigpu.checkpoint.dcp_files.check_files`), or its
            tensors would take more than ``max_expansion`` times its files' bytes.
    """
    index = read_metadata(folder)
    check_files(folder, index, read_manifest(folder) if is_sharded_folder(folder) else None)
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
    plain = {fqn: torch.empty(tuple(e.size), dtype=e.properties.dtype) for fqn, e in entries.values()}
    try:
        with _quiet():
            dcp.load(
                plain, storage_reader=_CheckedReader(folder, metadata), planner=_PlainValuesPlanner(), no_dist=True
            )
    except CheckpointError:
        raise
    except DCP_FAILURES as exc:
        raise CheckpointError(
            f"reading the tensors of {str(folder)!r} failed ({describe_failure(exc)}); the folder is damaged."
        ) from exc
    return OrderedDict((key, plain[fqn]) for key, (fqn, _) in entries.items())


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


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # DCP warns whenever it runs without a process group; reading alone is what is meant here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_GROUP)
        yield
