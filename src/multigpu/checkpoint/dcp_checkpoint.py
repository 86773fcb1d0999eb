"""A Checkpointer's save and resume for a model sharded by fsdp: every rank writes its own shards.

Save (every rank calls it):

1. rank 0 takes the folder's lock and creates a temporary folder ``.step-N.tmp-<host>-<pid>-...``,
   and tells every rank its name (or its failure: then every rank raises);
2. every rank writes its slices of the weights and optimizer state there with DCP
   (:func:`~multigpu.checkpoint.dcp_io.write_shards`, files flushed and ``fsync``ed); DCP's last
   step gathers every rank's result on rank 0, which writes the index: a barrier;
3. every rank sends rank 0 the sizes and CRC-32s of its files; rank 0 writes ``manifest.json`` and
   ``state.pt``, ``fsync``s the folder and renames it to ``step-N`` (a re-save swaps it in, as for
   unsharded checkpoints), prunes, and tells every rank it is done (or its failure).

Until that rename nothing carries the step's name, so a SIGKILL of any rank at any point leaves
the previous checkpoint whole and the latest; the temporary folder is deleted by the next save.

Resume checks everything (state, manifest, index, file sizes and CRC-32s, the saved tensors'
names and shapes against the model's and optimizer's) on every rank, then the ranks agree, so
a damaged checkpoint fails every rank with the same error instead of leaving some waiting;
DCP then reads each rank's slices into fresh tensors, and only then is anything changed.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from multigpu.checkpoint import dcp_io
from multigpu.checkpoint.atomic import (
    atomic_write_file,
    explain_os_errors,
    folder_lock,
    fsync_folder,
    install_folder,
    remove_stale_temporaries,
    remove_tree,
    temporary_name,
)
from multigpu.checkpoint.dcp_files import check_files, read_metadata
from multigpu.checkpoint.folders import (
    STATE_FILE,
    FileRecord,
    own_files,
    parse_aside,
    parse_step,
    read_manifest,
    recover_asides,
    write_manifest,
)
from multigpu.checkpoint.formats import load_torch_file
from multigpu.checkpoint.ranks import gather_on_main, is_distributed, run_on_main, shared_from_main
from multigpu.checkpoint.resume import restore_rank_rng
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
from multigpu.checkpoint.weights import describe_mismatch
from multigpu.core.keys import unwrap
from multigpu.distributed.failures import explain_collective_failures
from multigpu.distributed.runtime import global_rank, is_main_process, world_size
from multigpu.errors import CheckpointError, MultigpuError

T = TypeVar("T")


def save_sharded(
    folder: Path,
    target: Path,
    *,
    model: nn.Module,
    optimizer: Any | None,
    state: dict[str, Any],
    lock_timeout_s: float,
    prune: Callable[[int], None],
) -> None:
    """Write ``target`` (a ``step-N`` folder in ``folder``) as a sharded checkpoint; see the module docstring.

    Args:
        state: the entries of ``state.pt`` except ``optimizer`` and ``model_checksum`` (set here).
        prune: called on rank 0 with the step once the checkpoint is in place.

    Every rank must call it.
    """
    shards, plain_optimizer = dcp_io.live_state(model, optimizer)
    state = {**state, "optimizer": plain_optimizer}
    with contextlib.ExitStack() as held:  # rank 0 holds the folder's lock until the end
        tmp = Path(shared_from_main(lambda: str(_prepare(folder, target, lock_timeout_s, held)), f"preparing {target}"))
        try:
            try:
                with explain_collective_failures(f"writing the shards of checkpoint {target}"):
                    dcp_io.write_shards(tmp, shards)
            except MultigpuError:
                raise  # already explained (a collective timed out, a peer exited, ...)
            except dcp_io.DCP_FAILURES as exc:  # DCP gathers every rank's failure into one exception
                _raise_write_failure(target, exc)
            files = gather_on_main(_checksums(tmp), "the checksums of the checkpoint files")
            run_on_main(lambda: _finish(tmp, target, files or [], state, prune), f"saving checkpoint {target}")
        except BaseException:
            if is_main_process():
                remove_tree(tmp)
            raise


def _raise_write_failure(target: Path, exc: BaseException) -> NoReturn:
    causes = dcp_io.failure_causes(exc)
    os_error = next((cause for _, cause in causes if isinstance(cause, OSError)), None)
    if os_error is not None:
        with explain_os_errors(target):  # a full disk, a size limit, an unwritable folder: explained
            raise os_error from exc
    raise CheckpointError(
        f"could not write the shards of checkpoint {str(target)!r} ({dcp_io.describe_failure(exc)}). "
        "The previous checkpoint is unchanged."
    ) from exc


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
        remove_stale_temporaries(folder)
        tmp = temporary_name(target)
        tmp.mkdir()
    return tmp


def _checksums(tmp: Path) -> dict[str, FileRecord] | str:
    # A failure is sent to rank 0 as text rather than raised here, where rank 0 would wait for it.
    try:
        return own_files(tmp, global_rank())
    except OSError as exc:
        return f"rank {global_rank()} could not read back its files in {str(tmp)!r}: {exc}"


def _finish(
    tmp: Path,
    target: Path,
    reported: list[dict[str, FileRecord] | str],
    state: dict[str, Any],
    prune: Callable[[int], None],
) -> None:
    failed = [r for r in reported if isinstance(r, str)]
    if failed:
        raise CheckpointError(f"{failed[0]}. The previous checkpoint is unchanged.")
    files = {
        name: record for per_rank in reported if not isinstance(per_rank, str) for name, record in per_rank.items()
    }
    with explain_os_errors(target):
        state["model_checksum"] = write_manifest(tmp, step=state["step"], world_size=state["world_size"], files=files)
        atomic_write_file(tmp / STATE_FILE, lambda f: torch.save(state, f))
        fsync_folder(tmp)
        install_folder(tmp, target)
        prune(state["step"])


def _agreed(compute: Callable[[], T], what: str) -> T:
    """``compute()`` on every rank; if it fails on any rank, every rank raises (the first failing rank's error)."""
    failure: BaseException | None = None
    result: Any = None
    try:
        result = compute()
    except Exception as exc:
        failure = exc
    if not is_distributed():
        if failure is not None:
            raise failure
        return result  # type: ignore[no-any-return]
    problems: list[Any] = [None] * world_size()
    with explain_collective_failures(what):
        dist.all_gather_object(problems, None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    for rank, problem in enumerate(problems):
        if problem is not None:
            raise CheckpointError(f"rank {rank} refused the checkpoint, so every rank stops: {problem}")
    return result  # type: ignore[no-any-return]


# --- resume ---------------------------------------------------------------------------------------


def resume_sharded(
    folder: Path, *, model: nn.Module, parts: Mapping[str, Any], allow_unsafe_pickle: bool
) -> TrainingState:
    """Load the sharded checkpoint ``folder`` into ``model``, ``parts`` and this rank's RNG; all or nothing.

    Under a process group every rank must call it. Returns the checked training state.
    """
    optimizer = parts.get("optimizer")
    fresh = None if optimizer is None or optimizer.state else optimizer.state_dict()  # load_target may initialize it
    try:
        checked, target, metadata = _agreed(
            lambda: _check(folder, model, parts, allow_unsafe_pickle), f"checking checkpoint {folder}"
        )
        dcp_io.read_shards(folder, target, metadata, allow_unsafe_pickle=allow_unsafe_pickle)
    except BaseException:
        if optimizer is not None and fresh is not None:
            optimizer.load_state_dict(fresh)  # as it was: no state
        raise
    _apply(folder, checked, target, model, parts)
    return checked


def _check(
    folder: Path, model: nn.Module, parts: Mapping[str, Any], allow_unsafe_pickle: bool
) -> tuple[TrainingState, dict[str, Any], Metadata]:
    state_file = folder / STATE_FILE
    try:
        state = load_torch_file(state_file, allow_unsafe_pickle=allow_unsafe_pickle)
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{str(state_file)!r} is missing: {str(folder)!r} is not a complete checkpoint folder. Resume from "
            "another step (Checkpointer.resume(path=...)), or without path= to use the latest."
        ) from exc
    step_in_name = parse_step(folder.name)
    step_in_name = parse_aside(folder.name) if step_in_name is None else step_in_name
    checked = check_training_state(state, state_file, folder_step=step_in_name, allow_objects=allow_unsafe_pickle)
    manifest = read_manifest(folder)
    r = Refusal(state_file)
    if manifest.step != checked.step:
        r.fail("entry 'step'", checked.step, f"{manifest.step}, the step its manifest.json records")
    if checked.model_checksum != manifest.digest:
        r.fail("its model checksum", checked.model_checksum, f"{manifest.digest}, the shards' in manifest.json")
    metadata = read_metadata(folder)
    check_files(folder, metadata, manifest, rank=global_rank(), world_size=world_size())
    optimizer = parts.get("optimizer")
    in_shards = any(k.startswith(f"{dcp_io.OPTIMIZER}.") for k in metadata.state_dict_metadata)
    if optimizer is not None and checked.optimizer is None and not in_shards:
        raise CheckpointError(
            f"{str(folder)!r} holds no optimizer state, but an optimizer was passed to resume; pass "
            "optimizer=None or resume from a checkpoint saved with one."
        )
    if optimizer is not None and checked.optimizer is not None:
        check_optimizer(r, checked.optimizer, optimizer)  # saved before its first step: param groups only
    target = dcp_io.load_target(model, optimizer if in_shards else None)
    _check_shapes(folder, metadata, target, model)
    for name in ("scheduler", "scaler"):
        live, saved = parts.get(name), getattr(checked, name)
        if live is None:
            continue
        if saved is None:
            raise CheckpointError(
                f"{str(folder)!r} holds no {name} state, but a {name} was passed to resume; pass "
                f"{name}=None or resume from a checkpoint saved with one."
            )
        if name == "scaler" and saved:
            check_scaler(r, saved, live)
        elif name == "scheduler":
            check_like(r, saved, live.state_dict(), "entry 'scheduler'")
    return checked, target, metadata


def _check_shapes(folder: Path, metadata: Metadata, target: dict[str, Any], model: nn.Module) -> None:
    """The saved entries are exactly those ``target`` asks for, tensors with the same (whole) shapes."""
    saved = metadata.state_dict_metadata
    expected = dcp_io.flat_keys(target)
    prefix = f"{dcp_io.MODEL}."
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
    if dcp_io.OPTIMIZER not in target:
        return
    prefix = f"{dcp_io.OPTIMIZER}."
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


def _apply(
    folder: Path, checked: TrainingState, loaded: dict[str, Any], model: nn.Module, parts: Mapping[str, Any]
) -> None:
    """Apply a checked, fully read checkpoint; on an unexpected failure put back what can be put back."""
    optimizer = parts.get("optimizer")
    stage, applied = "model", []
    rng_before = capture_rng()
    try:
        for name in ("scheduler", "scaler"):
            live, saved = parts.get(name), getattr(checked, name)
            if live is None or (name == "scaler" and not saved):
                continue
            stage = name
            before = copy.deepcopy(live.state_dict())
            live.load_state_dict(saved)
            applied.append((live, before))
        stage = "model and optimizer"
        dcp_io.apply_state(model, optimizer if dcp_io.OPTIMIZER in loaded else None, loaded)
        if optimizer is not None and checked.optimizer is not None:
            optimizer.load_state_dict(checked.optimizer)
        stage = "random state"
        restore_rank_rng(checked, stacklevel=5)
    except Exception as exc:
        for live, before in reversed(applied):
            live.load_state_dict(before)
        restore_rng(rng_before)
        raise as_error(
            exc,
            folder,
            stage,
            "scheduler, scaler and random state were put back; the model and optimizer may be partly loaded.",
        ) from exc
