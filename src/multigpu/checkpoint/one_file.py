"""The one-file storage of a step folder: ``model.safetensors`` and ``manifest.json`` beside ``state.pt``.

The weights are one safetensors file with the bare model's keys (it loads into the bare model at any
world size with :func:`multigpu.load`), written by the main process; its header records the step.
``manifest.json`` records its size and CRC-32 (:mod:`manifest`, taken from the tensors while they are
written) and ``state.pt`` the manifest's digest, so weights and state of different saves are refused.
Reading takes the files as one version: another process re-saving the step swaps the folder
(:func:`~multigpu.checkpoint.atomic.install_folder`), so reading is retried until the folder is the
same before and after. A folder written before manifests (none there) is checked as it was written:
by the checksum in the weights' header (:mod:`safetensors_file`, checked as the file is read), which
``state.pt`` repeats.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from multigpu.checkpoint.atomic import FIX, MAX_STEP, STATE_FILE, regular_files
from multigpu.checkpoint.formats import (
    Structure,
    check_expansion,
    detect_format,
    read_structure,
    read_tensors,
    reading_file,
    write_safetensors,
)
from multigpu.checkpoint.manifest import (
    MANIFEST_FILE,
    FileRecord,
    Manifest,
    check_sizes,
    read_manifest,
    write_manifest,
)
from multigpu.checkpoint.ranks import Staging
from multigpu.checkpoint.safetensors_file import CHECKSUM_KEY, read_header
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.checkpoint.validate import Refusal, TrainingState
from multigpu.core.keys import plan_load, unwrap
from multigpu.errors import CheckpointError

T = TypeVar("T")
MODEL_FILE = "model.safetensors"
_ATTEMPTS = 3
_UNSHARDED_INTO_SHARDED = (
    "{folder!r} is an unsharded checkpoint (model.safetensors, saved without fsdp) and the model is sharded "
    "by fsdp: resuming its optimizer state into shards is not supported. Load its weights with "
    "multigpu.load(model, '{folder}') and start a fresh optimizer, or resume it without fsdp."
)


class OneFile:
    """``model.safetensors`` beside ``state.pt``, written by the main process alone (see the module docstring)."""

    name: ClassVar[str] = "safetensors"
    files: ClassVar[tuple[str, ...]] = (MODEL_FILE,)  # and MANIFEST_FILE, but for a folder written before manifests
    collective: ClassVar[bool] = False

    def __init__(self, model: nn.Module | None, optimizer: Any | None, *, folder: Path | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self._snapshot: tuple[Mapping[str, torch.Tensor], dict[str, Any] | None] | None = None
        self._tensors: Mapping[str, torch.Tensor] = {}
        self._metadata: Mapping[str, str] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self._manifest: Manifest | None = None

    # --- the folder ---

    @classmethod
    def serves(cls, model: nn.Module) -> bool:
        return not any(isinstance(p, DTensor) for p in unwrap(model).parameters())  # fsdp's: the sharded storage

    @classmethod
    def holds(cls, folder: Path) -> bool:
        return os.path.lexists(folder / MODEL_FILE)

    @classmethod
    def is_complete(cls, folder: Path) -> bool:
        return regular_files(folder, (MODEL_FILE, STATE_FILE))

    @classmethod
    def recorded_step(cls, folder: Path) -> int | None:
        try:
            text = read_header(folder / MODEL_FILE).metadata.get("step")
        except (CheckpointError, OSError):
            return None
        if text is None or not (text.isascii() and text.isdigit()) or len(text) > 19 or str(int(text)) != text:
            return None
        return int(text) if int(text) <= MAX_STEP else None

    @classmethod
    def describe(
        cls, folder: Path, *, allow_unsafe_pickle: bool
    ) -> tuple[Path, str, int, Structure, dict[str, str], dict[str, Any]]:
        path = folder / MODEL_FILE
        _checked_manifest(folder)  # sizes only: inspect reads no data
        structure, metadata = read_structure(path, allow_unsafe_pickle=allow_unsafe_pickle)
        return path, detect_format(path), path.stat().st_size, structure, metadata, {}

    @classmethod
    def read_weights(
        cls, folder: Path, *, allow_unsafe_pickle: bool, max_expansion: float
    ) -> tuple[Mapping[str, torch.Tensor], dict[str, str]]:
        _checked_manifest(folder)  # and read_tensors the CRC-32 (manifest.check_listed)
        tensors, metadata = read_tensors(folder / MODEL_FILE, allow_unsafe_pickle=allow_unsafe_pickle)
        check_expansion(tensors, folder / MODEL_FILE, max_expansion=max_expansion)
        return tensors, metadata

    # --- save ---

    def staged(self, staging: Staging) -> OneFile:
        """The storage over a copy of the weights and the optimizer state made now through ``staging``."""
        snapshot = staging.copy((unwrap(self._model()).state_dict(), self.saved_optimizer()))
        storage = OneFile(None, None)
        storage._snapshot = (snapshot[0], snapshot[1])
        return storage

    def saved_optimizer(self) -> dict[str, Any] | None:
        if self._snapshot is not None:
            return self._snapshot[1]
        return None if self.optimizer is None else self.optimizer.state_dict()

    def write(self, tmp: Path, target: Path, step: int) -> FileRecord:
        weights = self._snapshot[0] if self._snapshot is not None else unwrap(self._model()).state_dict()
        return write_safetensors(weights, tmp / MODEL_FILE, metadata={"step": str(step)}, stamped=False)

    def seal(self, tmp: Path, written: list[Any], step: int, world_size: int) -> str:
        files = {MODEL_FILE: written[0]}
        return write_manifest(tmp, format=self.name, step=step, world_size=world_size, files=files)

    # --- resume ---

    def _model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("a staged OneFile only writes its snapshot")  # (a bug in multigpu)
        return self.model

    def read(self, locate: Callable[[], Path | None], *, allow_unsafe_pickle: bool) -> tuple[Path, Any] | None:
        for _ in range(_ATTEMPTS):
            folder = locate()
            if folder is None:
                return None
            if not OneFile.serves(self._model()):
                raise CheckpointError(_UNSHARDED_INTO_SHARDED.format(folder=str(folder)))
            try:
                before = _identity(folder)
                state = load_torch_file(folder / STATE_FILE, allow_unsafe_pickle=allow_unsafe_pickle)
                self._manifest = _checked_manifest(folder)  # and read_tensors the CRC-32
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
        # The manifest's digest; in a folder written before manifests, the checksum in the weights' header.
        stored = self._metadata.get(CHECKSUM_KEY) if self._manifest is None else self._manifest.digest
        if checked.model_checksum is not None and stored != checked.model_checksum:
            Refusal(folder / MODEL_FILE).fail(
                "its checksum", stored, f"{checked.model_checksum}, the weights saved with state.pt"
            )
        self._weights = plan_load(self._model(), self._tensors, strict=True, source=repr(str(folder / MODEL_FILE)))
        return False

    def load(self, folder: Path, *, allow_unsafe_pickle: bool) -> None:
        pass  # read whole by read()

    def apply(self) -> None:
        unwrap(self._model()).load_state_dict(self._weights, strict=False)

    def discard(self) -> None:
        self._tensors, self._weights = OrderedDict(), {}

    def agreed(self, compute: Callable[[], T]) -> T:
        return compute()  # no collective: any rank may resume alone


def _checked_manifest(folder: Path) -> Manifest | None:
    """The manifest of ``folder``, the sizes of the files it lists checked; ``None`` in a folder written before manifests.

    The CRC-32 of the weights is checked as they are read (:func:`~multigpu.checkpoint.manifest.check_listed`).
    """
    os.stat(folder / MODEL_FILE)  # absent (a dangling link too): FileNotFoundError, an incomplete folder to readers
    with reading_file(folder / MODEL_FILE):  # a pipe, a folder: named
        if not os.path.lexists(folder / MANIFEST_FILE):
            if CHECKSUM_KEY in read_header(folder / MODEL_FILE).metadata:
                return None  # the weights' header holds their checksum
            raise CheckpointError(
                f"{str(folder / MANIFEST_FILE)!r} is missing: nothing records the checksum of {MODEL_FILE}. {FIX}"
            )
        manifest = read_manifest(folder, format=OneFile.name, required=MODEL_FILE)
        check_sizes(folder, manifest)
    return manifest


def _identity(folder: Path) -> tuple[int, ...]:
    stats = [os.stat(folder), os.stat(folder / MODEL_FILE), os.stat(folder / STATE_FILE)]
    return tuple(x for s in stats for x in (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns))


def _still(folder: Path, before: tuple[int, ...]) -> bool:
    try:
        return _identity(folder) == before
    except OSError:
        return False
