"""Full training state: save every N steps, keep the last few, resume exactly where a run stopped.

    ckpt = multigpu.Checkpointer(folder="runs/a", keep_last=3)
    resumed = ckpt.resume(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    start = resumed.step if resumed else 0
    for step in range(start, total):
        ...
        ckpt.save(step=step + 1, model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                  epoch=epoch, data_position={"batch": i + 1})

A checkpoint is a folder ``step-00000042/`` holding ``model.safetensors`` (clean keys; loads
into the bare model at any world size with :func:`multigpu.load`) and ``state.pt`` (optimizer,
LR scheduler, gradient scaler, step, epoch, data position, and every rank's random state; plain
tensors and containers only, so it loads weights-only). The folder appears in one atomic
rename, so a crash mid-save leaves the previous step as the latest.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from multigpu.checkpoint.atomic import (
    atomic_folder,
    atomic_write_file,
    remove_stale_temporaries,
    remove_tree,
)
from multigpu.checkpoint.formats import load_torch_file, write_tensors
from multigpu.checkpoint.keys import clean_state_dict, unwrap
from multigpu.checkpoint.ranks import gather_on_main, global_rank, run_on_main, world_size
from multigpu.checkpoint.rng import capture_rng, restore_rng
from multigpu.checkpoint.weights import load
from multigpu.errors import CheckpointError, ConfigError

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_SAFE_LEAVES = (int, float, str, bool, type(None), torch.Tensor)


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``: optimizers, schedulers, scalers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class Resumed:
    """Where a resumed run stands: the counters and data position saved with the checkpoint."""

    path: Path  # the checkpoint folder resumed from
    step: int  # optimizer steps taken before the save
    epoch: int
    data_position: dict[str, Any]  # as passed to save (e.g. {"batch": 17})
    extra: dict[str, Any]
    saved_world_size: int


@dataclass(kw_only=True)
class Checkpointer:
    """Saves and resumes full training state in ``folder``, keeping the last ``keep_last`` steps.

    Args:
        folder: where ``step-NNNNNNNN/`` folders go; created on the first save.
        keep_last: how many checkpoints to keep (older ones are deleted after a successful save);
            ``None`` keeps all.
    """

    folder: Path
    keep_last: int | None = 3

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ConfigError(f"keep_last={self.keep_last!r} must be a positive int or None (keep all).")

    def save(
        self,
        *,
        step: int,
        model: nn.Module,
        optimizer: Stateful | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        epoch: int = 0,
        data_position: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write the full training state as ``step-<step>/``, atomically, then prune old steps.

        Args:
            step: optimizer steps taken so far (the step to resume at).
            model: wrapped or bare; saved with clean keys.
            optimizer, scheduler, scaler: saved through their ``state_dict()``.
            epoch: the current epoch.
            data_position: where the data loader stands (ints/strings), e.g. ``{"batch": 17}``.
            extra: anything else made of tensors, numbers, strings, lists and dicts.

        Returns:
            The checkpoint folder.

        Raises:
            CheckpointError: the folder could not be written; previous checkpoints are intact.

        Every rank must call it: the random states of all ranks are gathered, rank 0 writes,
        the others return when the checkpoint is complete.
        """
        if step < 0:
            raise ConfigError(f"step={step} must be >= 0 (the number of optimizer steps taken).")
        counters = {"data_position": dict(data_position or {}), "extra": dict(extra or {})}
        for name, value in counters.items():
            _check_weights_only_safe(value, name)
        rngs = gather_on_main(capture_rng(), "random states")
        target = self.folder / f"step-{step:08d}"

        def write() -> Path:  # runs on the main process only
            state = {
                "format_version": 1,
                "step": int(step),
                "epoch": int(epoch),
                "world_size": world_size(),
                "rng": rngs,
                "optimizer": None if optimizer is None else optimizer.state_dict(),
                "scheduler": None if scheduler is None else scheduler.state_dict(),
                "scaler": None if scaler is None else scaler.state_dict(),
                **counters,
            }
            return self._write(target, clean_state_dict(unwrap(model).state_dict()), state)

        run_on_main(write, f"saving checkpoint {target}")
        return target

    def resume(
        self,
        *,
        model: nn.Module,
        optimizer: Stateful | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        path: str | os.PathLike[str] | None = None,
        allow_unsafe_pickle: bool = False,
    ) -> Resumed | None:
        """Load the latest checkpoint (or ``path``) into the given objects and this rank's RNG.

        Returns:
            What was resumed, or ``None`` when the folder holds no checkpoint yet.

        Any rank may call it and every rank should: each reads the files and takes its own
        random state. Resuming at another world size loads everything except the random state
        of ranks that did not exist before (a warning says so: the run then differs from the
        uninterrupted one).
        """
        found = Path(path) if path is not None else self.latest()
        if found is None:
            return None
        state = load_torch_file(found / STATE_FILE, allow_unsafe_pickle=allow_unsafe_pickle)
        load(model, found / MODEL_FILE)
        for name, target in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
            _load_part(name, target, state.get(name), found)
        _restore_this_rank_rng(state["rng"], state["world_size"])
        return Resumed(
            path=found,
            step=state["step"],
            epoch=state["epoch"],
            data_position=state["data_position"],
            extra=state["extra"],
            saved_world_size=state["world_size"],
        )

    def latest(self) -> Path | None:
        """The newest complete checkpoint folder, or ``None``."""
        return find_latest(self.folder)

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints in the folder, oldest first."""
        return [step for step, _ in _complete_checkpoints(self.folder)]

    def _write(self, target: Path, tensors: Mapping[str, torch.Tensor], state: dict[str, Any]) -> Path:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create the checkpoint folder {str(self.folder)!r}: {exc.strerror}. "
                "Pick a folder this process may write to."
            ) from exc
        remove_stale_temporaries(self.folder)
        with atomic_folder(target) as tmp:
            write_tensors(tensors, tmp / MODEL_FILE, metadata={"step": str(state["step"])})
            atomic_write_file(tmp / STATE_FILE, lambda f: torch.save(state, f))
        self._prune()
        return target

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        complete = _complete_checkpoints(self.folder)
        for _, old in complete[: max(0, len(complete) - self.keep_last)]:
            remove_tree(old)


def find_latest(folder: str | os.PathLike[str]) -> Path | None:
    """The complete ``step-N`` checkpoint folder with the highest N in ``folder``, or ``None``.

    Temporary folders of interrupted saves are never returned.

    Example:
        >>> find_latest("/nonexistent") is None
        True
    """
    complete = _complete_checkpoints(Path(folder))
    return complete[-1][1] if complete else None


def _complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / MODEL_FILE).is_file() and (entry / STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _load_part(name: str, target: Stateful | None, saved: Any, path: Path) -> None:
    if target is None:
        return
    if saved is None:
        raise CheckpointError(
            f"{str(path)!r} holds no {name} state, but a {name} was passed to resume; pass "
            f"{name}=None or resume from a checkpoint saved with one."
        )
    if name == "scaler" and not saved:
        return  # a disabled GradScaler saves {} and refuses to load it; nothing to restore
    target.load_state_dict(saved)


def _restore_this_rank_rng(rngs: list[Any], saved_world_size: int) -> None:
    rank = global_rank()
    if saved_world_size != world_size():
        warnings.warn(
            f"resuming at world_size={world_size()} from a checkpoint saved at world_size="
            f"{saved_world_size}: model and optimizer load, but random streams differ from the "
            "original run, so results will not match it bit for bit.",
            RuntimeWarning,
            stacklevel=3,
        )
    if rank < len(rngs):
        restore_rng(rngs[rank])


def _check_weights_only_safe(value: Any, where: str) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_weights_only_safe(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_weights_only_safe(item, f"{where}[{i}]")
    elif not isinstance(value, _SAFE_LEAVES):
        raise ConfigError(
            f"{where} is a {type(value).__name__} ({value!r}); checkpoints hold only tensors, "
            "numbers, strings, lists and dicts so they load without unpickling code. Convert it."
        )
