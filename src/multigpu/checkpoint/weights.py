"""A checkpoint's weights by path: save and load them (clean keys, atomic writes, mismatches explained),
read them whole, and describe them without a model (``multigpu ckpt inspect``/``convert``).

    multigpu.save(model, "net.safetensors")   # DataParallel / DDP / torch.compile: bare keys
    multigpu.load(model, "net.safetensors")   # also accepts files with module. / _orig_mod. keys

safetensors is the default format; a ``.pt``/``.pth``/``.bin`` suffix (or ``format="torch"``)
writes torch's format. Loading never runs code from the file (see :mod:`formats`).

Under fsdp (FSDP2) a module's ``state_dict()`` holds DTensors: each rank owns a slice of every
parameter. A weights file holds whole tensors, so saving gathers them first, with
torch.distributed.checkpoint's state-dict helpers (:func:`full_state_dict`; the keys stay the
module's own: ``fully_shard`` adds no prefix). Loading goes the other way: each rank cuts its own
slices out of the whole tensors it read, without communicating (:func:`shard_like`).

A path is a weights file, a folder a storage holds (a ``step-N`` folder, or any DCP checkpoint folder,
read by its storage: :mod:`storages`), or, for :func:`summarize`, a Checkpointer's folder (its latest
step). A summary reads headers only: the safetensors header, a torch file's pickle with its tensors
on the ``meta`` device, DCP's index; every field shown is type- and range-checked first.
"""

from __future__ import annotations

import math
import os
import reprlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from multigpu.checkpoint.atomic import MAX_STEP, STATE_FILE, files_bytes
from multigpu.checkpoint.formats import (
    Format,
    Structure,
    check_expansion,
    detect_format,
    read_structure,
    read_tensors,
    write_tensors,
)
from multigpu.checkpoint.ranks import run_on_main
from multigpu.checkpoint.storages import STORAGES, find_latest, reading, storage_of
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.checkpoint.validate import check_training_state
from multigpu.core.keys import clean_state_dict, find_prefixes, plan_load, unwrap
from multigpu.errors import CheckpointError

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxstring = 3, 8, 8, 60


def save(
    model: nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    format: Format | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write the weights of ``model`` (or a state dict) to ``path``, atomically, with bare keys.

    Args:
        model: a module, wrapped or not (saved with the bare module's keys), or a state dict
            (saved as given, less a wrapper prefix that every key carries).
        path: the file to write; its folder must exist.
        format: ``"safetensors"`` or ``"torch"``; by default from the suffix, safetensors otherwise.
            A ``.safetensors`` name in torch format (or a torch suffix in safetensors format) is
            refused with :class:`~multigpu.errors.ConfigError`.
        metadata: strings stored in the safetensors header (ignored for torch format).

    Returns:
        The path written.

    Raises:
        CheckpointError: the file could not be written (full disk, unwritable folder); any
            previous file at ``path`` is unchanged.

    Under a process group with several ranks every rank must call it: rank 0 writes, the
    others wait until the file is complete. A model sharded by fsdp is gathered first (the
    whole weights, written once by rank 0, in the same format).

    Example:
        >>> import tempfile
        >>> p = save(nn.DataParallel(nn.Linear(2, 1)), Path(tempfile.mkdtemp()) / "w.safetensors")
        >>> sorted(read_tensors(p)[0])
        ['bias', 'weight']
    """
    # A module's own keys are exact once its wrappers are removed (under fsdp, gathered from the
    # shards on every rank); a bare state dict can only lose a prefix chain that every key carries.
    tensors = full_state_dict(unwrap(model)) if isinstance(model, nn.Module) else clean_state_dict(model)
    written = run_on_main(lambda: write_tensors(tensors, path, format=format, metadata=metadata), f"saving {path}")
    return Path(written) if written is not None else Path(path)


def load(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    strip: str | Sequence[str] = (),
    allow_unsafe_pickle: bool = False,
) -> nn.Module:
    """Load weights from ``path`` into ``model`` (wrapped or not); keys may carry wrapper prefixes.

    Args:
        model: the module to fill; a DataParallel/DDP/compiled wrapper is unwrapped.
        path: a safetensors or torch file (format detected from its bytes), or a Checkpointer's step
            folder: its ``model.safetensors``, or, sharded (under fsdp), its whole weights.
        strict: raise when keys or shapes differ; with ``False`` load the keys that match.
        strip: extra key prefixes to remove (e.g. ``("model.",)`` for a Lightning checkpoint): module paths,
            ``"model"`` meaning ``model.``; one string is one prefix.
        allow_unsafe_pickle: allow torch files that need arbitrary unpickling. Only for files
            you trust.

    Returns:
        ``model``, for chaining.

    Raises:
        CheckpointError: keys or shapes differ (``strict``); the message lists the missing,
            unexpected and shape-different keys and the likely cause. Also when the file is
            damaged or not a weights file, or when several of its keys differ only by wrapper
            prefixes (``module.weight`` and ``weight``): the message lists them. The model is
            unchanged in every case.

    Any rank may call it; it does not communicate. Into a model sharded by fsdp, each rank
    reads the whole file and keeps its own slices.

    Example:
        >>> import tempfile
        >>> p = save(nn.Linear(2, 1), Path(tempfile.mkdtemp()) / "w.safetensors")
        >>> load(nn.DataParallel(nn.Linear(2, 1)), p).__class__.__name__
        'DataParallel'
    """
    tensors, _ = read_weights(path, allow_unsafe_pickle=allow_unsafe_pickle)
    usable = plan_load(model, tensors, strict=strict, strip=strip, source=str(path))
    bare = unwrap(model)
    bare.load_state_dict(shard_like(bare.state_dict(), usable), strict=False)  # fsdp: each rank takes its slices
    return model


def read_weights(
    path: str | os.PathLike[str], *, allow_unsafe_pickle: bool = False, max_expansion: float = math.inf
) -> tuple[OrderedDict[str, torch.Tensor], dict[str, str]]:
    """The whole tensors and metadata of a weights file, or of a folder a storage holds (a step folder, any DCP folder).

    A folder is read by its storage (:mod:`storages`), by this process alone.

    Raises:
        CheckpointError: the file or folder is damaged, or its tensors, made contiguous, would take
            more than ``max_expansion`` times its bytes on disk.
    """
    folder = Path(path)
    if folder.is_dir():
        storage = storage_of(folder)
        if storage is None:
            raise CheckpointError(
                f"{str(path)!r} is a folder without {' or '.join(s.files[0] for s in STORAGES)} (a checkpoint's "
                "weights); give a weights file, or a step-N folder a Checkpointer wrote."
            )
        with reading(folder):
            tensors, metadata = storage.read_weights(
                folder, allow_unsafe_pickle=allow_unsafe_pickle, max_expansion=max_expansion
            )
        return OrderedDict(tensors), metadata
    tensors, metadata = read_tensors(path, allow_unsafe_pickle=allow_unsafe_pickle)
    check_expansion(tensors, path, max_expansion=max_expansion)
    return tensors, metadata


# --- models sharded by fsdp: whole tensors gathered to save, each rank's slices cut out to load ---


def full_state_dict(model: nn.Module) -> Mapping[str, torch.Tensor]:
    """``model.state_dict()`` with sharded entries gathered into whole CPU tensors.

    Args:
        model: the bare model (unwrapped).

    Returns:
        For a sharded model: the full state dict on rank 0 and an empty one on the other ranks.
        Otherwise ``model.state_dict()`` on every rank.

    For a sharded model every rank must call it (it all-gathers each tensor); otherwise it does
    not communicate.

    Example:
        >>> list(full_state_dict(nn.Linear(2, 1)))
        ['weight', 'bias']
    """
    state = model.state_dict()
    if not any(isinstance(value, DTensor) for value in state.values()):  # not sharded by fsdp
        return state
    # Imported here: torch.distributed.checkpoint is only needed for sharded models.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # One tensor at a time is gathered and moved to the CPU, and kept on rank 0 only: the full
    # model never sits on any device, nor on the other ranks.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(Mapping[str, torch.Tensor], full)


def shard_like(expected: Mapping[str, object], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (whole, shapes checked) cut into this rank's slices wherever ``expected`` (the target model's
    ``state_dict()``) holds a DTensor: a DTensor of the same mesh and placements, ready for ``load_state_dict``.

    Does not communicate: every rank holds the whole tensors and keeps its own slice.
    """
    out = dict(tensors)
    for key, value in tensors.items():
        target = expected.get(key)
        if isinstance(target, DTensor):
            # src_data_rank=None: each rank slices its local copy instead of receiving rank 0's.
            out[key] = distribute_tensor(
                value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
            )
    return out


# --- what a checkpoint holds, without a model (multigpu ckpt inspect, convert) ---


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    key: str  # as stored in the file (prefixes included)
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Summary:
    """A checkpoint described: see :func:`summarize`."""

    path: Path  # the weights file (or sharded checkpoint folder) described
    format: str  # "safetensors", "torch", or the storage's name ("dcp")
    size_on_disk: int  # bytes of the file (or of the whole step folder)
    tensors: list[TensorInfo]
    prefixes: dict[str, int]  # wrapper prefix -> number of keys carrying it
    step: int | None  # the saved step, where the checkpoint records one
    metadata: dict[str, str] = field(default_factory=dict)
    training_state: dict[str, Any] = field(default_factory=dict)  # from a step folder's state.pt

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def weights_file(path: str | os.PathLike[str]) -> Path:
    """The checkpoint behind ``path``: the file itself, a folder a storage holds, or a Checkpointer folder's latest step.

    A folder of a storage (a step folder, or any DCP checkpoint folder) is returned as the folder.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is not a file or folder (or does not exist); give a weights file or a checkpoint folder."
        )
    if storage_of(path) is not None:
        return path
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(
            f"{str(path)!r} holds no checkpoint: none of {[s.files[0] for s in STORAGES]} and no complete step-N "
            "folder. Give a weights file, a step folder, or the folder a Checkpointer saved into."
        )
    return latest


def summarize(path: str | os.PathLike[str], *, allow_unsafe_pickle: bool = False) -> Summary:
    """Describe the checkpoint at ``path``: a weights file, or a folder through the storage that holds it.

    Example:
        >>> import tempfile
        >>> p = save({"module.w": torch.zeros(2, 3)}, Path(tempfile.mkdtemp()) / "w.safetensors")
        >>> s = summarize(p); (s.format, [t.key for t in s.tensors], s.prefixes)
        ('safetensors', ['w'], {})
    """
    found = weights_file(path)
    storage = storage_of(found) if found.is_dir() else None
    if storage is None:
        structure, metadata = read_structure(found, allow_unsafe_pickle=allow_unsafe_pickle)
        return _summary(found, detect_format(found), found.stat().st_size, structure, metadata, _step_in(metadata), {})
    with reading(found):
        shown, format, size, structure, metadata, facts = storage.describe(
            found, allow_unsafe_pickle=allow_unsafe_pickle
        )
    state = _training_state(found, allow_unsafe_pickle)
    if state:
        facts = {**state, **facts, "optimizer": state["optimizer"] or facts.get("optimizer", False)}
        size = files_bytes(found)
    step = state["step"] if state else storage.recorded_step(found)
    return _summary(shown, format, size, structure, metadata, step, facts)


def _summary(
    path: Path,
    format: str,
    size: int,
    structure: Structure,
    metadata: dict[str, str],
    step: int | None,
    facts: dict[str, Any],
) -> Summary:
    return Summary(
        path=path,
        format=format,
        size_on_disk=size,
        tensors=[
            TensorInfo(
                key=k, shape=shape, dtype=str(dtype).replace("torch.", ""), nbytes=math.prod(shape) * dtype.itemsize
            )
            for k, shape, dtype in structure
        ],
        prefixes=find_prefixes(k for k, _, _ in structure),
        step=step,
        metadata=metadata,
        training_state=facts,
    )


def _step_in(metadata: dict[str, str]) -> int | None:
    # Header metadata is free text: show it as a step only if it is one.
    text = metadata.get("step", "")
    if not (text.isascii() and text.isdigit() and len(text) <= 19):
        return None
    return int(text) if int(text) <= MAX_STEP else None


def _training_state(folder: Path, allow_unsafe_pickle: bool) -> dict[str, Any]:
    path = folder / STATE_FILE
    if not path.is_file():
        return {}
    loaded = load_torch_file(path, allow_unsafe_pickle=allow_unsafe_pickle, map_location="meta")
    checked = check_training_state(loaded, folder, meta=True)
    return {
        "step": checked.step,  # shown as the saved step
        "epoch": checked.epoch,
        "world_size": checked.world_size,
        "data_position": _SHORT.repr(checked.data_position),
        "optimizer": checked.optimizer is not None,
        "scheduler": checked.scheduler is not None,
        "scaler": bool(checked.scaler),
        "random states": len(checked.rng),
    }
