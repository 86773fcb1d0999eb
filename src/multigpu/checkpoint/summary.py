"""What a checkpoint holds, without a model: keys, shapes, dtypes, sizes, step, format, prefixes.

Backs ``multigpu ckpt inspect`` and ``multigpu ckpt convert``. Accepts a weights file
(safetensors or torch), a ``step-N`` checkpoint folder (either format: ``model.safetensors``, or
sharded with torch.distributed.checkpoint, :mod:`dcp_files`), any DCP checkpoint folder, or a
:class:`Checkpointer` folder (its latest step). Nothing here executes code from a file (see
:mod:`formats`), and a summary reads headers only: the safetensors header, a torch file's pickle
with its tensors mapped to the ``meta`` device (shapes without data), or DCP's index (its
``.metadata``, unpickled safely). Every field shown is type- and range-checked first.
"""

from __future__ import annotations

import math
import os
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from multigpu.checkpoint.dcp_files import (
    checked_index,
    files_bytes,
    is_dcp_folder,
    model_entries,
)
from multigpu.checkpoint.folders import (
    MAX_STEP,
    METADATA_FILE,
    MODEL_FILE,
    STATE_FILE,
    find_latest,
    is_sharded_folder,
    parse_aside,
    parse_step,
)
from multigpu.checkpoint.formats import Format, detect_format, read_structure
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
    format: Format | Literal["dcp"]
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
    """The weights behind ``path``: the file itself, a step folder's file, the latest step's, or a DCP folder.

    A sharded checkpoint (a folder holding DCP's ``.metadata``) is returned as the folder itself.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is not a file or folder (or does not exist); give a weights file or a checkpoint folder."
        )
    if (path / MODEL_FILE).is_file():
        return path / MODEL_FILE
    if is_dcp_folder(path):
        return path
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(
            f"{str(path)!r} holds no checkpoint: no {MODEL_FILE}, no DCP {METADATA_FILE} and no complete step-N "
            "folder. Give a weights file, a step folder, or the folder a Checkpointer saved into."
        )
    return latest if is_sharded_folder(latest) else latest / MODEL_FILE


def summarize(path: str | os.PathLike[str], *, allow_unsafe_pickle: bool = False) -> Summary:
    """Describe the checkpoint at ``path``.

    Example:
        >>> import tempfile, torch
        >>> from multigpu.checkpoint.weights import save
        >>> p = save({"module.w": torch.zeros(2, 3)}, Path(tempfile.mkdtemp()) / "w.safetensors")
        >>> s = summarize(p); (s.format, [t.key for t in s.tensors], s.prefixes)
        ('safetensors', ['w'], {})
    """
    weights = weights_file(path)
    if weights.is_dir():
        return _summarize_sharded(weights, allow_unsafe_pickle)
    structure, metadata = read_structure(weights, allow_unsafe_pickle=allow_unsafe_pickle)
    state = _training_state(weights.parent, allow_unsafe_pickle) if weights.name == MODEL_FILE else {}
    step = state["step"] if state else _step_in(metadata)
    return Summary(
        path=weights,
        format=detect_format(weights),
        size_on_disk=_size_on_disk(weights, bool(state)),
        tensors=[
            TensorInfo(key=k, shape=shape, dtype=str(dtype).replace("torch.", ""), nbytes=_nbytes(shape, dtype))
            for k, shape, dtype in structure
        ],
        prefixes=find_prefixes(k for k, _, _ in structure),
        step=step,
        metadata=metadata,
        training_state=state,
    )


def _summarize_sharded(folder: Path, allow_unsafe_pickle: bool) -> Summary:
    index, manifest = checked_index(folder, crc=False)  # sizes only: inspect reads no data
    structure = [(key, tuple(e.size), e.properties.dtype) for key, (_, e) in model_entries(index).items()]
    state = _training_state(folder, allow_unsafe_pickle) if (folder / STATE_FILE).is_file() else {}
    if state:  # the optimizer's state lies in the shards, unless it had not stepped yet (then in state.pt)
        state["optimizer"] = state["optimizer"] or any(k.startswith("optimizer.") for k in index.state_dict_metadata)
    shards = sorted({i.relative_path for i in index.storage_data.values()})
    step = state["step"] if state else (manifest.step if manifest else None)
    return Summary(
        path=folder,
        format="dcp",
        size_on_disk=files_bytes(folder),
        tensors=[
            TensorInfo(key=k, shape=shape, dtype=str(dtype).replace("torch.", ""), nbytes=_nbytes(shape, dtype))
            for k, shape, dtype in structure
        ],
        prefixes=find_prefixes(k for k, _, _ in structure),
        step=step,
        training_state={**state, "shard files": len(shards)},
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


def _size_on_disk(weights: Path, whole_folder: bool) -> int:
    if not whole_folder:
        return weights.stat().st_size
    return sum(p.stat().st_size for p in weights.parent.iterdir() if p.is_file())
