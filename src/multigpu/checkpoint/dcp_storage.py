"""The sharded storage of a step folder (fsdp): every rank writes and reads its own slices with DCP.

Save (every rank, protocol.save_step): rank 0 takes the folder's lock
and creates the temporary folder; every rank writes its slices of the weights and optimizer state
there with DCP (:func:`~multigpu.checkpoint.dcp_io.write_shards`, files flushed and ``fsync``ed;
DCP's last step gathers every rank's result on rank 0, which writes the index: a barrier); every
rank sends rank 0 the sizes and CRC-32s of its files, and rank 0 writes ``manifest.json``
(:mod:`folders`), ``state.pt``, and renames the folder into place.

Resume (every rank under a process group, :func:`~multigpu.checkpoint.protocol.resume_step`):
everything (state, manifest, index, file sizes and CRC-32s, the saved tensors' names and shapes
against the model's and optimizer's) is checked on every rank, then the ranks agree, so a damaged
checkpoint fails every rank with the same error instead of leaving some waiting; DCP then reads
each rank's slices into fresh tensors, and only then is anything changed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from multigpu.checkpoint import dcp_io
from multigpu.checkpoint.atomic import explain_os_errors
from multigpu.checkpoint.dcp_files import check_files, read_metadata
from multigpu.checkpoint.folders import STATE_FILE, FileRecord, own_files, read_manifest, write_manifest
from multigpu.checkpoint.ranks import agreed
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.checkpoint.validate import Refusal, TrainingState
from multigpu.checkpoint.weights import describe_mismatch
from multigpu.core.keys import unwrap
from multigpu.errors import CheckpointError, MultigpuError
from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.world import global_rank, world_size

T = TypeVar("T")


class Sharded:
    """DCP's files and ``manifest.json`` beside ``state.pt``: see the module docstring.

    Args:
        model, optimizer: the live objects saved from or resumed into.
        folder: the step folder being resumed (names it in errors of the ranks' agreement).
    """

    collective = True

    def __init__(self, model: nn.Module, optimizer: Any | None, *, folder: Path | None = None) -> None:
        self.model, self.optimizer, self.folder = model, optimizer, folder
        self._target: dict[str, Any] = {}
        self._metadata: Metadata | None = None
        # What an optimizer that has not stepped yet looks like: loading targets initialize its state.
        self._fresh = None if optimizer is None or optimizer.state else optimizer.state_dict()

    # --- save ---

    def saved_optimizer(self) -> dict[str, Any] | None:
        # What DCP writes is taken here, once, on every rank (it does not communicate).
        self._shards, plain = dcp_io.live_state(self.model, self.optimizer)
        return plain

    def write(self, tmp: Path, target: Path, step: int) -> dict[str, FileRecord] | str:
        try:
            with explain_collective_failures(f"writing the shards of checkpoint {target}"):
                dcp_io.write_shards(tmp, self._shards)
        except MultigpuError:
            raise  # already explained (a collective timed out, a peer exited, ...)
        except dcp_io.DCP_FAILURES as exc:  # DCP gathers every rank's failure into one exception
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
        return write_manifest(tmp, step=step, world_size=world_size, files=files)

    # --- resume ---

    def read(self, locate: Callable[[], Path | None], *, allow_unsafe_pickle: bool) -> tuple[Path, Any] | None:
        folder = locate()
        if folder is None:
            return None
        state_file = folder / STATE_FILE
        try:
            return folder, load_torch_file(state_file, allow_unsafe_pickle=allow_unsafe_pickle)
        except FileNotFoundError as exc:
            raise CheckpointError(
                f"{str(state_file)!r} is missing: {str(folder)!r} is not a complete checkpoint folder. Resume from "
                "another step (Checkpointer.resume(path=...)), or without path= to use the latest."
            ) from exc

    def check(self, folder: Path, checked: TrainingState) -> bool:
        manifest = read_manifest(folder)
        r = Refusal(folder / STATE_FILE)
        if manifest.step != checked.step:
            r.fail("entry 'step'", checked.step, f"{manifest.step}, the step its manifest.json records")
        if checked.model_checksum != manifest.digest:
            r.fail("its model checksum", checked.model_checksum, f"{manifest.digest}, the shards' in manifest.json")
        self._metadata = read_metadata(folder)
        check_files(folder, self._metadata, manifest, rank=global_rank(), world_size=world_size())
        in_shards = any(k.startswith(f"{dcp_io.OPTIMIZER}.") for k in self._metadata.state_dict_metadata)
        self._target = dcp_io.load_target(self.model, self.optimizer if in_shards else None)
        _check_shapes(folder, self._metadata, self._target, self.model)
        return in_shards

    def load(self, folder: Path, *, allow_unsafe_pickle: bool) -> None:
        if self._metadata is None:
            raise CheckpointError(f"{str(folder)!r} was not checked before it was read (a bug in multigpu).")
        dcp_io.read_shards(folder, self._target, self._metadata, allow_unsafe_pickle=allow_unsafe_pickle)

    def apply(self) -> None:
        dcp_io.apply_state(self.model, self.optimizer if dcp_io.OPTIMIZER in self._target else None, self._target)

    def discard(self) -> None:
        if self.optimizer is not None and self._fresh is not None:
            self.optimizer.load_state_dict(self._fresh)  # as it was: no state

    def agreed(self, compute: Callable[[], T]) -> T:
        return agreed(compute, f"checking checkpoint {self.folder}")


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
