"""What a checkpoint holds, without a model: keys, shapes, dtypes, sizes, step, format, prefixes.

Backs ``multigpu ckpt inspect`` and ``multigpu ckpt convert``. Accepts a weights file
(safetensors or torch), a folder one of the storages holds (a ``step-N`` checkpoint folder, or any
DCP checkpoint folder), or a :class:`Checkpointer` folder (its latest step). A folder's model part
is described by its storage (:mod:`storages`), its ``state.pt`` here. Nothing here executes code
from a file (see :mod:`formats`), and a summary reads headers only: the safetensors header, a torch
file's pickle with its tensors mapped to the ``meta`` device (shapes without data), or DCP's index
(its ``.metadata``, unpickled safely). Every field shown is type- and range-checked first.
"""

from __future__ import annotations

import math
import os
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from multigpu.checkpoint.dcp_files import files_bytes
from multigpu.checkpoint.folders import MAX_STEP, STATE_FILE, parse_aside, parse_step
from multigpu.checkpoint.formats import detect_format, read_structure
from multigpu.checkpoint.storages import STORAGES, Structure, find_latest, reading, storage_of
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.checkpoint.validate import check_counters
from multigpu.core.keys import find_prefixes
from multigpu.errors import CheckpointError

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxstring = 3, 8, 8, 60


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
        >>> import tempfile, torch
        >>> from multigpu.checkpoint.weights import save
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
            TensorInfo(key=k, shape=shape, dtype=str(dtype).replace("torch.", ""), nbytes=_nbytes(shape, dtype))
            for k, shape, dtype in structure
        ],
        prefixes=find_prefixes(k for k, _, _ in structure),
        step=step,
        metadata=metadata,
        training_state=facts,
    )


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


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
    folder_step = parse_step(folder.name)
    checked = check_counters(
        loaded, path, folder_step=folder_step if folder_step is not None else parse_aside(folder.name), device="meta"
    )
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
