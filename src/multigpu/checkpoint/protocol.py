"""One save path and one resume path for a step folder, written once over every storage.

A step folder holds ``state.pt`` (step, epoch, random states, scheduler, scaler, the optimizer
when the storage does not hold it) beside the model's storage, one of
:data:`~multigpu.checkpoint.storages.STORAGES`, written by the main process or, collective, by every rank.

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
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from multigpu.checkpoint.atomic import (
    STATE_FILE,
    atomic_write_file,
    explain_os_errors,
    folder_lock,
    fsync,
    install_folder,
    remove_stale_temporaries,
    remove_tree,
    temporary_name,
)
from multigpu.checkpoint.ranks import capture_rng, gather_on_main, restore_rng, run_on_main, shared_from_main
from multigpu.checkpoint.storages import Storage, Writes, check_replaceable, recover_asides
from multigpu.checkpoint.validate import (
    Refusal,
    TrainingState,
    check_like,
    check_optimizer,
    check_scaler,
    check_training_state,
)
from multigpu.errors import CheckpointError
from multigpu.runtime.world import global_rank, is_main_process, world_size

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
        checked = check_training_state(state, folder, allow_objects=allow_unsafe_pickle)
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
        if checked.world_size != world_size():
            warnings.warn(
                f"resuming at world_size={world_size()} from a checkpoint saved at world_size="
                f"{checked.world_size}: model and optimizer load, but random streams differ from the "
                "original run, so results will not match it bit for bit.",
                RuntimeWarning,
                stacklevel=4,
            )
        if global_rank() < len(checked.rng):
            restore_rng(checked.rng[global_rank()])
    except Exception as exc:
        for live, before in reversed(applied):
            live.load_state_dict(before)
        restore_rng(rng_before)
        note = "optimizer, scheduler, scaler and random state were put back"
        if stage in ("model", "random state"):
            note += "; the model (and an optimizer saved in shards) may be partly loaded."
        else:
            note += "; the model is unchanged."
        raise CheckpointError(
            f"{str(folder)!r}: applying the {stage} state failed ({type(exc).__name__}: {str(exc)[:300]}); {note}"
        ) from exc
