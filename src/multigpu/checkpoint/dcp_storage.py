"""The sharded storage of a step folder (fsdp): every rank writes and reads its own slices with DCP.

What DCP saves is ``{"model": ..., "optimizer": ...}`` from torch's ``get_state_dict`` (the bare
model's keys; under fsdp this rank's slices, DTensors; the optimizer flattened to one entry per
value). Save: every rank writes its files into the temporary folder and reads them back for their CRC-32s;
rank 0 writes the index, ``manifest.json`` (each file's size and CRC-32, :mod:`manifest`) and ``state.pt``. Resume: every
check (state, manifest, index, files, names and shapes against the live objects) runs on every
rank and the ranks agree before DCP reads anything, so a damaged checkpoint fails every rank
with the same error; then each rank's slices are read into fresh tensors, and only then applied.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, NoReturn, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from multigpu.checkpoint.atomic import STATE_FILE, explain_os_errors, regular_files
from multigpu.checkpoint.dcp_files import (
    DCP_FAILURES,
    FORMAT,
    METADATA_FILE,
    MODEL,
    _quiet,
    check_files,
    checked_index,
    dcp_load,
    describe_failure,
    failure_causes,
    files_bytes,
    model_entries,
    own_files,
    read_dcp_manifest,
    read_metadata,
    read_sharded_weights,
    recorded_step,
)
from multigpu.checkpoint.manifest import MANIFEST_FILE, FileRecord, write_manifest
from multigpu.checkpoint.ranks import Staging, agreed, thread_group
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.checkpoint.validate import Refusal, TrainingState
from multigpu.core.keys import describe_mismatch, unwrap
from multigpu.devices import get_device_type
from multigpu.errors import CheckpointError, MultigpuError
from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.world import global_rank, world_size

T = TypeVar("T")
OPTIMIZER = "optimizer"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# --- DCP's state of a model and optimizer --------------------------------------------------------


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


def write_shards(folder: Path, state: dict[str, Any]) -> None:
    """Save ``state`` into ``folder`` with DCP: each rank its slices, rank 0 the index.

    Every rank of the process group must call it (DCP's collectives go over this thread's checkpoint
    group, :func:`~multigpu.checkpoint.ranks.thread_group`). Every file is flushed and ``fsync``ed.
    """
    writer = _Writer(folder, sync_files=True)
    if _grouped():  # (no warnings filter: catch_warnings is not thread-safe, and this may run in the background)
        dcp.save(state, storage_writer=writer, process_group=thread_group())
        return
    with _quiet():
        dcp.save(state, storage_writer=writer, no_dist=True)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, raising the ``OSError`` behind a short write of a tensor as itself.

    DCP writes each tensor with ``torch.save``, which reports a write past a file-size limit or onto a full
    disk as ``RuntimeError: ... unexpected pos``, the ``OSError`` only its context; the context does not
    travel when DCP gathers the ranks' failures, so no rank could tell the cause.
    """

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)  # (one thread: a failure is raised here)
        except RuntimeError as exc:
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from exc
            raise


def read_shards(folder: Path, target: dict[str, Any], metadata: Metadata, *, allow_unsafe_pickle: bool = False) -> None:
    """Fill ``target`` (from :func:`load_target`) from the checked DCP folder ``folder`` (:func:`dcp_load`).

    Under a process group every rank must call it; without one it reads alone.

    Raises:
        CheckpointError: DCP failed to read (the message names the folder and DCP's reason).
    """
    try:
        with explain_collective_failures(f"reading checkpoint {folder}"):
            dcp_load(folder, target, metadata, no_dist=not _grouped(), allow_unsafe_pickle=allow_unsafe_pickle)
    except MultigpuError:
        raise  # a damaged value (CheckpointError), a collective that timed out, a peer that exited
    except DCP_FAILURES as exc:  # DCP wraps every rank's failure in a CheckpointException
        raise CheckpointError(
            f"reading the sharded checkpoint {str(folder)!r} failed ({describe_failure(exc)}). "
            "Resume from another step (Checkpointer.resume(path=...)) if it is damaged."
        ) from exc


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


# --- the storage ---------------------------------------------------------------------------------


class Sharded:
    """DCP's files and ``manifest.json`` beside ``state.pt``: see the module docstring.

    Args:
        model, optimizer: the live objects saved from or resumed into.
        folder: the step folder being resumed (names it in errors of the ranks' agreement).
    """

    name: ClassVar[str] = FORMAT
    files: ClassVar[tuple[str, ...]] = (METADATA_FILE, MANIFEST_FILE)
    collective: ClassVar[bool] = True

    # --- the folder ---

    @classmethod
    def serves(cls, model: nn.Module) -> bool:
        return is_sharded_model(model)

    @classmethod
    def holds(cls, folder: Path) -> bool:
        # Any entry of that name counts (a pipe, a folder, a dangling link): reading it then says what is wrong.
        # (Not the manifest's name: a one-file folder holds one too.)
        return os.path.lexists(folder / METADATA_FILE)

    @classmethod
    def is_complete(cls, folder: Path) -> bool:
        return regular_files(folder, (*cls.files, STATE_FILE))

    @classmethod
    def recorded_step(cls, folder: Path) -> int | None:
        return recorded_step(folder)

    @classmethod
    def describe(
        cls, folder: Path, *, allow_unsafe_pickle: bool
    ) -> tuple[Path, str, int, list[tuple[str, tuple[int, ...], Any]], dict[str, str], dict[str, Any]]:
        index, _ = checked_index(folder, crc=False)  # sizes only: inspect reads no data
        structure = [(key, tuple(e.size), e.properties.dtype) for key, (_, e) in model_entries(index).items()]
        facts: dict[str, Any] = {"shard files": len({i.relative_path for i in index.storage_data.values()})}
        if any(k.startswith(f"{OPTIMIZER}.") for k in index.state_dict_metadata):
            facts["optimizer"] = True  # in the shards (state.pt holds it only before its first step)
        return folder, cls.name, files_bytes(folder), structure, {}, facts

    @classmethod
    def read_weights(
        cls, folder: Path, *, allow_unsafe_pickle: bool, max_expansion: float
    ) -> tuple[Mapping[str, torch.Tensor], dict[str, str]]:
        step = recorded_step(folder)  # a DCP folder written elsewhere has none
        return read_sharded_weights(folder, max_expansion=max_expansion), {} if step is None else {"step": str(step)}

    def __init__(self, model: nn.Module, optimizer: Any | None, *, folder: Path | None = None) -> None:
        self.model, self.optimizer, self.folder = model, optimizer, folder
        self._target: dict[str, Any] = {}
        self._metadata: Metadata | None = None
        # What an optimizer that has not stepped yet looks like: loading targets initialize its state.
        self._fresh = None if optimizer is None or optimizer.state else optimizer.state_dict()
        self._shards: dict[str, Any] = {}
        self._plain: dict[str, Any] | None = None
        self._staged = False  # a snapshot (staged()): writes what was copied then

    # --- save ---

    def saved_optimizer(self) -> dict[str, Any] | None:
        if not self._staged:  # what DCP writes is taken here, once, on every rank (it does not communicate)
            self._shards, self._plain = live_state(self.model, self.optimizer)
        return self._plain

    def staged(self, staging: Staging) -> Sharded:
        """This rank's shards copied into host memory by DCP's stager, the rest through ``staging``.

        DCP's ``DefaultStager`` (what ``torch.distributed.checkpoint.async_save`` stages with) keeps one host
        copy per source storage, weakly keyed, pinned where the device wants it; kept in ``staging`` between
        saves, it copies into the same memory again. ``async_save`` itself is not called: its thread would
        write into a folder the protocol creates only on the write's side (under the folder's lock), and the
        sealing, rename and agreement of the ranks come after DCP's write on the same thread.
        """
        shards, plain = live_state(self.model, self.optimizer)
        stager = staging.kept.get(self.name)
        if stager is None:
            local = [v.to_local() if isinstance(v, DTensor) else v for part in shards.values() for v in part.values()]
            devices = {t.device for t in local if isinstance(t, torch.Tensor) and t.device.type != "cpu"}
            pin = any(get_device_type(d).pin_memory for d in devices)
            stager = staging.kept[self.name] = DefaultStager(StagingOptions(pin, False, False, False))  # synchronous
        snapshot = Sharded(self.model, None)
        copied = stager.stage(shards)  # synchronous staging: the copy, not a future of it
        snapshot._shards = copied if isinstance(copied, dict) else copied.result()
        snapshot._plain, snapshot._staged = staging.copy(plain), True
        return snapshot

    def write(self, tmp: Path, target: Path, step: int) -> dict[str, FileRecord] | str:
        try:
            with explain_collective_failures(f"writing the shards of checkpoint {target}"):
                write_shards(tmp, self._shards)
        except MultigpuError:
            raise  # already explained (a collective timed out, a peer exited, ...)
        except DCP_FAILURES as exc:  # DCP gathers every rank's failure into one exception
            _raise_write_failure(target, exc)
        # A failure is sent to rank 0 as text rather than raised here, where rank 0 would wait for it.
        try:
            return own_files(tmp, global_rank())
        except OSError as exc:
            return f"rank {global_rank()} could not read back its files in {str(tmp)!r}: {exc}"

    def seal(self, tmp: Path, written: list[Any], step: int, world_size: int) -> str:
        failed = [r for r in written if isinstance(r, str)]
        if failed:
            raise CheckpointError(f"{failed[0]}. The previous checkpoint is unchanged.")
        files = {name: record for per_rank in written for name, record in per_rank.items()}
        return write_manifest(tmp, format=self.name, step=step, world_size=world_size, files=files)

    # --- resume ---

    def read(self, locate: Callable[[], Path | None], *, allow_unsafe_pickle: bool) -> tuple[Path, Any] | None:
        folder = locate()
        if folder is None:
            return None
        state_file = folder / STATE_FILE
        try:
            return folder, load_torch_file(state_file, allow_unsafe_pickle=allow_unsafe_pickle)
        except OSError as exc:  # missing, a folder, a pipe, unreadable
            raise CheckpointError(
                f"{str(state_file)!r} is missing or unreadable ({exc.strerror or exc}): {str(folder)!r} is not a "
                "complete checkpoint folder. Resume from another step (Checkpointer.resume(path=...)), or without "
                "path= to use the latest."
            ) from exc

    def check(self, folder: Path, checked: TrainingState) -> bool:
        manifest = read_dcp_manifest(folder)
        r = Refusal(folder / STATE_FILE)
        if manifest.step != checked.step:
            r.fail("entry 'step'", checked.step, f"{manifest.step}, the step its manifest.json records")
        if checked.model_checksum != manifest.digest:
            r.fail("its model checksum", checked.model_checksum, f"{manifest.digest}, the shards' in manifest.json")
        self._metadata = read_metadata(folder)
        check_files(folder, self._metadata, manifest, rank=global_rank(), world_size=world_size())
        in_shards = any(k.startswith(f"{OPTIMIZER}.") for k in self._metadata.state_dict_metadata)
        self._target = load_target(self.model, self.optimizer if in_shards else None)
        _check_shapes(folder, self._metadata, self._target, self.model)
        return in_shards

    def load(self, folder: Path, *, allow_unsafe_pickle: bool) -> None:
        if self._metadata is None:
            raise CheckpointError(f"{str(folder)!r} was not checked before it was read (a bug in multigpu).")
        read_shards(folder, self._target, self._metadata, allow_unsafe_pickle=allow_unsafe_pickle)

    def apply(self) -> None:
        apply_state(self.model, self.optimizer if OPTIMIZER in self._target else None, self._target)

    def discard(self) -> None:
        if self.optimizer is not None and self._fresh is not None:
            self.optimizer.load_state_dict(self._fresh)  # as it was: no state

    def agreed(self, compute: Callable[[], T]) -> T:
        return agreed(compute, f"checking checkpoint {self.folder}")


def _raise_write_failure(target: Path, exc: BaseException) -> NoReturn:
    causes = failure_causes(exc)
    os_error = next((cause for _, cause in causes if isinstance(cause, OSError)), None)
    if os_error is not None:
        with explain_os_errors(target):  # a full disk, a size limit, an unwritable folder: explained
            raise os_error from exc
    raise CheckpointError(
        f"could not write the shards of checkpoint {str(target)!r} ({describe_failure(exc)}). "
        "The previous checkpoint is unchanged."
    ) from exc


def _check_shapes(folder: Path, metadata: Metadata, target: dict[str, Any], model: nn.Module) -> None:
    """The saved entries are exactly those ``target`` asks for, tensors with the same (whole) shapes."""
    saved = metadata.state_dict_metadata
    expected = flatten_state_dict(target)[0]  # DCP's keys: {"model": {"w": t}} -> "model.w"
    prefix = f"{MODEL}."
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
    if OPTIMIZER not in target:
        return
    prefix = f"{OPTIMIZER}."
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
