"""Resume from a checkpoint folder: read it consistently, check all of it, then apply all of it.

Nothing is applied until everything is checked (:mod:`validate`, :func:`weights.plan_load`).
Applying then goes optimizer, scheduler, scaler, model, random state; if anything still fails
(a custom ``load_state_dict`` that raises), the optimizer, scheduler, scaler and random state are
put back and a :class:`~multigpu.errors.CheckpointError` says what happened.

The folder may be replaced while it is read (another process re-saving its step swaps the
folder, :mod:`swap`): reading is retried until the folder is the same before and after.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from multigpu.checkpoint.folders import MODEL_FILE, STATE_FILE, parse_aside, parse_step
from multigpu.checkpoint.formats import load_torch_file, read_tensors
from multigpu.checkpoint.integrity import CHECKSUM_KEY
from multigpu.checkpoint.rng import capture_rng, restore_rng
from multigpu.checkpoint.validate import (
    Refusal,
    TrainingState,
    as_error,
    check_like,
    check_optimizer,
    check_scaler,
    check_training_state,
)
from multigpu.checkpoint.weights import plan_load
from multigpu.core.keys import unwrap
from multigpu.distributed.runtime import global_rank, world_size
from multigpu.errors import CheckpointError

_ATTEMPTS = 3


def read_checkpoint(
    locate: Callable[[], Path | None], *, allow_unsafe_pickle: bool
) -> tuple[Path, Any, OrderedDict[str, torch.Tensor], dict[str, str]] | None:
    """The folder ``locate()`` names, its unpickled state, its tensors and their metadata, read as one version.

    Returns:
        ``None`` when ``locate()`` finds no checkpoint.
    """
    for _ in range(_ATTEMPTS):
        folder = locate()
        if folder is None:
            return None
        try:
            before = _identity(folder)
            state = load_torch_file(folder / STATE_FILE, allow_unsafe_pickle=allow_unsafe_pickle)
            tensors, metadata = read_tensors(folder / MODEL_FILE, allow_unsafe_pickle=allow_unsafe_pickle)
            if _identity(folder) == before:
                return folder, state, tensors, metadata
        except CheckpointError:
            if _still(folder, before):
                raise  # damaged, not replaced while we read it
        except OSError as exc:
            missing = _missing(folder)
            if not isinstance(exc, FileNotFoundError) or (missing and locate() == folder):
                # Not a race with another saver: the folder is incomplete or not a folder.
                raise CheckpointError(
                    f"{str(folder)!r} is not a complete checkpoint folder ({', '.join(missing) or exc.strerror} "
                    "missing or unreadable). Give a step-N folder written by a Checkpointer, or resume without "
                    "path= to use the latest."
                ) from exc
    raise CheckpointError(
        f"the checkpoint kept changing while it was read ({_ATTEMPTS} attempts): another process is "
        "saving into this folder right now. Resume when it is done."
    )


def check_all(
    folder: Path,
    state: Any,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    model: nn.Module,
    parts: Mapping[str, Any],
    *,
    allow_objects: bool = False,
) -> tuple[TrainingState, dict[str, torch.Tensor]]:
    """The checked state and the model's tensors, or CheckpointError; changes nothing."""
    step_in_name = parse_step(folder.name)
    if step_in_name is None:
        step_in_name = parse_aside(folder.name)
    checked = check_training_state(state, folder / STATE_FILE, folder_step=step_in_name, allow_objects=allow_objects)
    if checked.model_checksum is not None and metadata.get(CHECKSUM_KEY) != checked.model_checksum:
        Refusal(folder / MODEL_FILE).fail(
            "its checksum", metadata.get(CHECKSUM_KEY), f"{checked.model_checksum}, the weights saved with state.pt"
        )
    weights = plan_load(model, tensors, strict=True, source=repr(str(folder / MODEL_FILE)))
    r = Refusal(folder / STATE_FILE)
    for name, target in parts.items():
        if target is None:
            continue
        saved = getattr(checked, name)
        if saved is None:
            raise CheckpointError(
                f"{str(folder)!r} holds no {name} state, but a {name} was passed to resume; pass "
                f"{name}=None or resume from a checkpoint saved with one."
            )
        if name == "optimizer":
            check_optimizer(r, saved, target)
        elif name == "scaler":
            if saved:  # a disabled GradScaler saves {}: nothing to restore
                check_scaler(r, saved, target)
        else:
            check_like(r, saved, target.state_dict(), f"entry {name!r}")
    return checked, weights


def apply_all(
    folder: Path, checked: TrainingState, weights: dict[str, torch.Tensor], model: nn.Module, parts: Mapping[str, Any]
) -> None:
    """Apply a checked state; on an unexpected failure put back what was applied and raise."""
    applied: list[tuple[Any, Any]] = []
    rng_before = capture_rng()
    stage = "model"
    try:
        for name, target in parts.items():
            saved = getattr(checked, name)
            if target is None or (name == "scaler" and not saved):
                continue
            stage = name
            before = target.state_dict()
            before = before if name == "optimizer" else copy.deepcopy(before)  # loading never mutates these
            target.load_state_dict(saved)
            applied.append((target, before))
        stage = "model"
        unwrap(model).load_state_dict(weights, strict=False)
        stage = "random state"
        restore_rank_rng(checked)
    except Exception as exc:
        for target, before in reversed(applied):
            target.load_state_dict(before)
        restore_rng(rng_before)
        note = "optimizer, scheduler, scaler and random state were put back"
        note += (
            "; the model may be partly loaded." if stage in ("model", "random state") else "; the model is unchanged."
        )
        raise as_error(exc, folder, stage, note) from exc


def restore_rank_rng(checked: TrainingState, *, stacklevel: int = 4) -> None:
    """Restore this rank's saved random state; warn when the world size changed since the save."""
    rank = global_rank()
    if checked.world_size != world_size():
        warnings.warn(
            f"resuming at world_size={world_size()} from a checkpoint saved at world_size="
            f"{checked.world_size}: model and optimizer load, but random streams differ from the "
            "original run, so results will not match it bit for bit.",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    if rank < len(checked.rng):
        restore_rng(checked.rng[rank])


def _identity(folder: Path) -> tuple[int, ...]:
    stats = [os.stat(folder), os.stat(folder / MODEL_FILE), os.stat(folder / STATE_FILE)]
    return tuple(x for s in stats for x in (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns))


def _still(folder: Path, before: tuple[int, ...]) -> bool:
    try:
        return _identity(folder) == before
    except OSError:
        return False


def _missing(folder: Path) -> list[str]:
    return [name for name in (MODEL_FILE, STATE_FILE) if not (folder / name).is_file()]
