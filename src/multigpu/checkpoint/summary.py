"""What a checkpoint holds, without a model: keys, shapes, dtypes, sizes, step, format, prefixes.

Backs ``multigpu ckpt inspect`` and ``multigpu ckpt convert``. Accepts a weights file
(safetensors or torch), a ``step-N`` checkpoint folder, or a :class:`Checkpointer` folder (its
latest step). Nothing here executes code from a file (see :mod:`formats`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multigpu.checkpoint.formats import Format, detect_format, load_torch_file, read_tensors
from multigpu.checkpoint.keys import find_prefixes
from multigpu.checkpoint.state import MODEL_FILE, STATE_FILE, find_latest
from multigpu.errors import CheckpointError


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    key: str  # as stored in the file (prefixes included)
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Summary:
    """A checkpoint described: see :func:`summarize`."""

    path: Path  # the weights file described
    format: Format
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
    """The weights file behind ``path``: the file itself, a step folder's, or the latest step's."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} does not exist; give a weights file or a checkpoint folder.")
    if (path / MODEL_FILE).is_file():
        return path / MODEL_FILE
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(
            f"{str(path)!r} holds no checkpoint: no {MODEL_FILE} and no complete step-N folder. "
            "Give a weights file, a step folder, or the folder a Checkpointer saved into."
        )
    return latest / MODEL_FILE


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
    tensors, metadata = read_tensors(weights, allow_unsafe_pickle=allow_unsafe_pickle)
    state = _training_state(weights.parent / STATE_FILE, allow_unsafe_pickle) if weights.name == MODEL_FILE else {}
    step = state.get("step", metadata.get("step"))
    return Summary(
        path=weights,
        format=detect_format(weights),
        size_on_disk=_size_on_disk(weights, bool(state)),
        tensors=[
            TensorInfo(key=k, shape=tuple(v.shape), dtype=str(v.dtype).replace("torch.", ""), nbytes=v.nbytes)
            for k, v in tensors.items()
        ],
        prefixes=find_prefixes(tensors),
        step=int(step) if step is not None else None,
        metadata=metadata,
        training_state=state,
    )


def _training_state(path: Path, allow_unsafe_pickle: bool) -> dict[str, Any]:
    if not path.is_file():
        return {}
    state = load_torch_file(path, allow_unsafe_pickle=allow_unsafe_pickle)
    return {
        "step": state.get("step"),  # shown as the saved step
        "epoch": state.get("epoch"),
        "world_size": state.get("world_size"),
        "data_position": state.get("data_position"),
        "optimizer": state.get("optimizer") is not None,
        "scheduler": state.get("scheduler") is not None,
        "scaler": bool(state.get("scaler")),
        "random states": len(state.get("rng") or []),
    }


def _size_on_disk(weights: Path, whole_folder: bool) -> int:
    if not whole_folder:
        return weights.stat().st_size
    return sum(p.stat().st_size for p in weights.parent.iterdir() if p.is_file())
