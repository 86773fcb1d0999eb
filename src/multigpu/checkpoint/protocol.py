"""One save path and one resume path for a step folder, written once over two storages.

A step folder holds ``state.pt`` (step, epoch, random states, scheduler, scaler, the optimizer
when it is not sharded) beside the model's storage, which is either

* one file, ``model.safetensors`` (:class:`OneFile`), written by the main process, or
* sharded, torch.distributed.checkpoint's files and ``manifest.json``
  (:class:`~multigpu.checkpoint.dcp_storage.Sharded`), written by every rank.

Save (:func:`save_step`): take the folder's lock and build ``.step-N.tmp-...`` (main process);
write the model's storage into it; seal it (record its checksum in ``state.pt``), then put the
folder under its name in one rename (:func:`~multigpu.checkpoint.atomic.install_folder`) and prune.
Until that rename nothing carries the step's name, so a kill at any point leaves the previous step
whole and the latest.

Resume (:func:`resume_step`) is all or nothing: read ``state.pt`` and the storage, check every
part of it against the given objects (:mod:`validate`; the storage checks the model's part), and
only then apply: optimizer, scheduler, scaler, model, random state. If applying still fails (a
custom ``load_state_dict`` that raises), what can be put back is, and a
:class:`~multigpu.errors.CheckpointError` says what happened.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from multigpu.checkpoint.atomic import (
    atomic_write_file,
    explain_os_errors,
    folder_lock,
    fsync,
    install_folder,
    remove_stale_temporaries,
    remove_tree,
    temporary_name,
)
from multigpu.checkpoint.folders import (
    MODEL_FILE,
    STATE_FILE,
    check_replaceable,
    parse_aside,
    parse_step,
    recover_asides,
)
from multigpu.checkpoint.formats import read_tensors, write_tensors
from multigpu.checkpoint.ranks import capture_rng, gather_on_main, restore_rng, run_on_main, shared_from_main
from multigpu.checkpoint.safetensors_file import CHECKSUM_KEY, read_header
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.checkpoint.validate import (
    Refusal,
    TrainingState,
    check_like,
    check_optimizer,
    check_scaler,
    check_training_state,
)
from multigpu.checkpoint.weights import plan_load
from multigpu.core.keys import unwrap
from multigpu.errors import CheckpointError, MultigpuError
from multigpu.runtime.world import global_rank, is_main_process, world_size

T = TypeVar("T")
_ATTEMPTS = 3


class Writes(Protocol):
    """The save side of a :class:`Storage` (all :func:`save_step` needs: a snapshot in memory has only this)."""

    collective: bool  # every rank writes and reads its own part (else the main process writes alone)

    def saved_optimizer(self) -> dict[str, Any] | None:
        """The optimizer state that goes into ``state.pt`` (``None``: none, or it is in the storage)."""

    def write(self, tmp: Path, target: Path, step: int) -> Any:
        """Write the model's files into ``tmp``; what it returns reaches :meth:`seal` (every rank's, if collective)."""

    def seal(self, tmp: Path, written: list[Any], step: int, world_size: int) -> str:
        """Finish the files (main process); returns the checksum ``state.pt`` records for them."""


class Storage(Writes, Protocol):
    """Where a step folder keeps the model (and perhaps the optimizer): what differs between the two kinds."""

    def read(self, locate: Callable[[], Path | None], *, allow_unsafe_pickle: bool) -> tuple[Path, Any] | None:
        """The folder ``locate()`` names and its unpickled ``state.pt``, the storage read as one version."""

    def check(self, folder: Path, checked: TrainingState) -> bool:
        """Check the storage against the model (and ``state.pt``); returns whether it holds the optimizer state."""

    def load(self, folder: Path, *, allow_unsafe_pickle: bool) -> None:
        """Read what :meth:`check` accepted into fresh tensors (the model is not changed yet)."""

    def apply(self) -> None:
        """Copy what was read into the model (and the optimizer, if the storage holds it)."""

    def discard(self) -> None:
        """Undo what checking or loading did to the live objects (resume failed before applying)."""

    def agreed(self, compute: Callable[[], T]) -> T:
        """``compute()``; for a collective storage, every rank raises if it failed on any rank."""


# --- save -----------------------------------------------------------------------------------------


def save_step(
    folder: Path,
    target: Path,
    storage: Writes,
    state: dict[str, Any],
    *,
    lock_timeout_s: float,
    prune: Callable[[int], None],
) -> None:
    """Write ``target`` (a ``step-N`` folder in ``folder``) with ``state.pt`` and ``storage``; see the module docstring.

    Args:
        state: the entries of ``state.pt`` except ``optimizer`` and ``model_checksum`` (set here).
        prune: called on the main process with the step once the checkpoint is in place.

    A collective storage: every rank must call it. Otherwise only the main process does.
    """
    state = {**state, "optimizer": storage.saved_optimizer()}
    collective = storage.collective
    with contextlib.ExitStack() as held:  # the main process holds the folder's lock until the end

        def prepare() -> str:  # main process: the lock, the temporary folder (every rank writes into it)
            return str(_prepare(folder, target, lock_timeout_s, held))

        tmp = Path(shared_from_main(prepare, f"preparing {target}") if collective else prepare())
        try:
            written = storage.write(tmp, target, state["step"])
            every = gather_on_main(written, "the checksums of the checkpoint files") if collective else [written]

            def finish() -> None:
                with explain_os_errors(target):
                    state["model_checksum"] = storage.seal(tmp, every or [], state["step"], state["world_size"])
                    atomic_write_file(tmp / STATE_FILE, lambda f: torch.save(state, f))
                    fsync(tmp)
                    install_folder(tmp, target)
                    prune(state["step"])

            if collective:
                run_on_main(finish, f"saving checkpoint {target}")
            else:
                finish()
        except BaseException:
            if is_main_process():
                remove_tree(tmp)
            raise


def _prepare(folder: Path, target: Path, lock_timeout_s: float, held: contextlib.ExitStack) -> Path:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(
            f"cannot create the checkpoint folder {str(folder)!r}: {exc.strerror}. "
            "Pick a folder this process may write to."
        ) from exc
    with explain_os_errors(target):
        held.enter_context(folder_lock(folder, timeout_s=lock_timeout_s))
        recover_asides(folder)
        check_replaceable(target)
        remove_stale_temporaries(folder)
        tmp = temporary_name(target)
        tmp.mkdir()
    return tmp


# --- resume ---------------------------------------------------------------------------------------


def resume_step(
    storage: Storage,
    locate: Callable[[], Path | None],
    parts: Mapping[str, Any],
    *,
    allow_unsafe_pickle: bool,
    also_check: Callable[[Path, TrainingState], None] | None = None,
) -> tuple[Path, TrainingState] | None:
    """Load the checkpoint ``locate()`` names into the model, ``parts`` and this rank's RNG; all or nothing.

    Args:
        parts: ``{"optimizer": ..., "scheduler": ..., "scaler": ...}``, ``None`` where not resumed.
        also_check: the caller's own check of the training state (raises), run with the others, before
            anything is applied.

    Returns:
        The folder and its checked training state, or ``None`` when ``locate()`` finds none.

    A collective storage: every rank must call it (the ranks check the folder and read it together).
    """

    def read_and_check() -> tuple[Path, TrainingState] | None:
        read = storage.read(locate, allow_unsafe_pickle=allow_unsafe_pickle)
        if read is None:
            return None
        folder, state = read
        step = parse_step(folder.name)
        step = parse_aside(folder.name) if step is None else step
        checked = check_training_state(state, folder / STATE_FILE, folder_step=step, allow_objects=allow_unsafe_pickle)
        in_storage = storage.check(folder, checked)
        _check_parts(folder, checked, parts, optimizer_in_storage=in_storage)
        if also_check is not None:
            also_check(folder, checked)
        return folder, checked

    try:
        found = storage.agreed(read_and_check)
        if found is None:
            return None
        storage.load(found[0], allow_unsafe_pickle=allow_unsafe_pickle)
    except BaseException:
        storage.discard()
        raise
    _apply(*found, storage, parts)
    return found


def _check_parts(folder: Path, checked: TrainingState, parts: Mapping[str, Any], *, optimizer_in_storage: bool) -> None:
    r = Refusal(folder / STATE_FILE)
    for name, live in parts.items():
        saved = getattr(checked, name)
        if live is None or (name == "optimizer" and saved is None and optimizer_in_storage):
            continue
        if saved is None:
            raise CheckpointError(
                f"{str(folder)!r} holds no {name} state, but a {name} was passed to resume; pass "
                f"{name}=None or resume from a checkpoint saved with one."
            )
        if name == "optimizer":
            check_optimizer(r, saved, live)  # saved before its first step (sharded): param groups only
        elif name == "scaler":
            if saved:  # a disabled GradScaler saves {}: nothing to restore
                check_scaler(r, saved, live)
        else:
            check_like(r, saved, live.state_dict(), f"entry {name!r}")


def _apply(folder: Path, checked: TrainingState, storage: Storage, parts: Mapping[str, Any]) -> None:
    """Apply a checked, fully read checkpoint; on an unexpected failure put back what can be put back."""
    applied: list[tuple[Any, Any]] = []
    rng_before = capture_rng()
    stage = "model"
    try:
        for name, live in parts.items():
            saved = getattr(checked, name)
            if live is None or saved is None or (name == "scaler" and not saved):
                continue  # (an optimizer whose state is in the storage is applied with the model)
            stage = name
            before = live.state_dict()
            before = before if name == "optimizer" else copy.deepcopy(before)  # loading never mutates these
            live.load_state_dict(saved)
            applied.append((live, before))
        stage = "model"
        storage.apply()
        stage = "random state"
        restore_rank_rng(checked)
    except Exception as exc:
        for live, before in reversed(applied):
            live.load_state_dict(before)
        restore_rng(rng_before)
        note = "optimizer, scheduler, scaler and random state were put back"
        if stage in ("model", "random state"):
            note += "; the model (and an optimizer saved in shards) may be partly loaded."
        else:
            note += "; the model is unchanged."
        raise as_error(exc, folder, stage, note) from exc


def restore_rank_rng(checked: TrainingState, *, stacklevel: int = 5) -> None:
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


def as_error(exc: Exception, folder: Path, stage: str, note: str) -> MultigpuError:
    """A CheckpointError for an unexpected failure while applying ``stage`` from ``folder``."""
    return CheckpointError(
        f"{str(folder)!r}: applying the {stage} state failed ({type(exc).__name__}: {str(exc)[:300]}); {note}"
    )


# --- the one-file storage: model.safetensors --------------------------------------------------------


class OneFile:
    """``model.safetensors`` beside ``state.pt``, written by the main process alone.

    Reading takes both files as one version: another process re-saving the step swaps the folder
    (:func:`~multigpu.checkpoint.atomic.install_folder`), so reading is retried until the folder is
    the same before and after.
    """

    collective = False

    def __init__(self, model: nn.Module, optimizer: Any | None) -> None:
        self.model, self.optimizer = model, optimizer
        self._tensors: Mapping[str, torch.Tensor] = {}
        self._metadata: Mapping[str, str] = {}
        self._weights: dict[str, torch.Tensor] = {}

    def saved_optimizer(self) -> dict[str, Any] | None:
        return None if self.optimizer is None else self.optimizer.state_dict()

    def write(self, tmp: Path, target: Path, step: int) -> str:
        write_tensors(unwrap(self.model).state_dict(), tmp / MODEL_FILE, metadata={"step": str(step)})
        return read_header(tmp / MODEL_FILE).metadata[CHECKSUM_KEY]

    def seal(self, tmp: Path, written: list[Any], step: int, world_size: int) -> str:
        return str(written[0])  # state.pt names the weights it belongs with (see safetensors_file.py)

    def read(self, locate: Callable[[], Path | None], *, allow_unsafe_pickle: bool) -> tuple[Path, Any] | None:
        for _ in range(_ATTEMPTS):
            folder = locate()
            if folder is None:
                return None
            try:
                before = _identity(folder)
                state = load_torch_file(folder / STATE_FILE, allow_unsafe_pickle=allow_unsafe_pickle)
                self._tensors, self._metadata = read_tensors(
                    folder / MODEL_FILE, allow_unsafe_pickle=allow_unsafe_pickle
                )
                if _identity(folder) == before:
                    return folder, state
            except CheckpointError:
                if _still(folder, before):
                    raise  # damaged, not replaced while we read it
            except OSError as exc:
                missing = [name for name in (MODEL_FILE, STATE_FILE) if not (folder / name).is_file()]
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

    def check(self, folder: Path, checked: TrainingState) -> bool:
        stored = self._metadata.get(CHECKSUM_KEY)
        if checked.model_checksum is not None and stored != checked.model_checksum:
            Refusal(folder / MODEL_FILE).fail(
                "its checksum", stored, f"{checked.model_checksum}, the weights saved with state.pt"
            )
        self._weights = plan_load(self.model, self._tensors, strict=True, source=repr(str(folder / MODEL_FILE)))
        return False

    def load(self, folder: Path, *, allow_unsafe_pickle: bool) -> None:
        pass  # read whole by read()

    def apply(self) -> None:
        unwrap(self.model).load_state_dict(self._weights, strict=False)

    def discard(self) -> None:
        self._tensors, self._weights = OrderedDict(), {}

    def agreed(self, compute: Callable[[], T]) -> T:
        return compute()  # no collective: any rank may resume alone


def _identity(folder: Path) -> tuple[int, ...]:
    stats = [os.stat(folder), os.stat(folder / MODEL_FILE), os.stat(folder / STATE_FILE)]
    return tuple(x for s in stats for x in (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns))


def _still(folder: Path, before: tuple[int, ...]) -> bool:
    try:
        return _identity(folder) == before
    except OSError:
        return False
