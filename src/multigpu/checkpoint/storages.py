"""The storages of a step folder, listed once, and what the list answers: which folders are checkpoints.

A step folder holds ``state.pt`` beside one storage's files. Each storage is one class that owns its
format: its files, how a folder is recognised as its own (:meth:`Storage.holds`), whether it is
complete, the step its files record, what ``multigpu ckpt inspect`` shows of it, its checksum, and
writing and reading it for :mod:`protocol`. :data:`STORAGES` lists them; everything here and in
:mod:`protocol`, :mod:`state` and :mod:`weights` asks the list and never names a format. Adding one is
a module and a line in :data:`STORAGES` (ARCHITECTURE.md, "Where to change a given thing").

Discovery: a checkpoint folder is named exactly ``f"step-{step:08d}"`` (:mod:`atomic`); anything else is
someone else's folder, never read, never pruned. It is complete when it is a real folder that a storage
holds completely. A step whose replacement was interrupted is found under its hidden aside name
(:func:`~multigpu.checkpoint.atomic.install_folder`). Layout and rules: docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import os
import stat
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import nn

from multigpu.checkpoint.atomic import PREFIX, STATE_FILE, folder_name, parse_aside, parse_step, remove_tree
from multigpu.checkpoint.dcp import Sharded
from multigpu.checkpoint.formats import Structure
from multigpu.checkpoint.one_file import OneFile
from multigpu.checkpoint.ranks import Staging
from multigpu.checkpoint.validate import TrainingState
from multigpu.errors import CheckpointError

T = TypeVar("T")


class Writes(Protocol):
    """The save side of a :class:`Storage` (all :func:`~multigpu.checkpoint.protocol.save_step` needs)."""

    collective: ClassVar[bool]  # every rank writes and reads its own part (else the main process writes alone)

    def saved_optimizer(self) -> dict[str, Any] | None:
        """The optimizer state that goes into ``state.pt`` (``None``: none, or it is in the storage)."""

    def write(self, tmp: Path, target: Path, step: int) -> Any:
        """Write the model's files into ``tmp``; what it returns reaches :meth:`seal` (every rank's, if collective)."""

    def seal(self, tmp: Path, written: list[Any], step: int, world_size: int) -> str:
        """Finish the files (main process); returns the checksum ``state.pt`` records for them."""


class Storage(Writes, Protocol):
    """One format of a step folder's model part (and perhaps the optimizer's): everything that differs between formats.

    The class answers for folders (no model needed); an instance, built with the live model and
    optimizer (and the folder being resumed), writes and reads.
    """

    name: ClassVar[str]  # the format ``multigpu ckpt inspect`` shows
    files: ClassVar[tuple[str, ...]]  # what a complete folder holds beside state.pt (the first names it in messages)

    def __init__(self, model: nn.Module, optimizer: Any | None, *, folder: Path | None = None) -> None: ...

    @classmethod
    def serves(cls, model: nn.Module) -> bool:
        """Whether a save of ``model`` goes to this storage (the first in :data:`STORAGES` that serves it)."""

    @classmethod
    def holds(cls, folder: Path) -> bool:
        """Whether ``folder`` is (meant to be) this storage's: any of its files is there, of any kind."""

    @classmethod
    def is_complete(cls, folder: Path) -> bool:
        """Whether ``folder`` holds ``state.pt`` and every file of this storage as regular files."""

    @classmethod
    def recorded_step(cls, folder: Path) -> int | None:
        """The step this storage's own files record (a Checkpointer writes it), or ``None``. Never raises."""

    @classmethod
    def describe(
        cls, folder: Path, *, allow_unsafe_pickle: bool
    ) -> tuple[Path, str, int, Structure, dict[str, str], dict[str, Any]]:
        """For ``ckpt inspect``, from headers only: the path shown, the format, its bytes on disk, every
        tensor's key, shape and dtype, metadata, and facts beyond ``state.pt``'s (e.g. ``{"shard files": 2}``)."""

    @classmethod
    def read_weights(
        cls, folder: Path, *, allow_unsafe_pickle: bool, max_expansion: float
    ) -> tuple[Mapping[str, torch.Tensor], dict[str, str]]:
        """The whole tensors of ``folder``'s model and their metadata (``multigpu.load``, ``ckpt convert``), read
        by this process alone; refuses tensors that take more than ``max_expansion`` times their bytes on disk."""

    def staged(self, staging: Staging) -> Writes:
        """This storage's writer over a copy in memory of what :meth:`write` would write, made now (``async_save``)
        through ``staging``, which the Checkpointer keeps so that the next save reuses its buffers. By the main
        process, or by every rank if collective (each then writes on its own thread, its collectives on a group
        of their own: :mod:`ranks`)."""

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


# The one list. Recognition asks in this order (the first that holds a folder), and so does a save (the
# first that serves the model).
STORAGES: tuple[type[Storage], ...] = (OneFile, Sharded)


def storage_of(folder: Path) -> type[Storage] | None:
    """The storage that holds ``folder``, or ``None`` (no storage's file is there)."""
    return next((s for s in STORAGES if s.holds(folder)), None)


def storage_for(model: nn.Module) -> type[Storage]:
    """The storage a save of ``model`` writes (the first in :data:`STORAGES` that serves it)."""
    found = next((s for s in STORAGES if s.serves(model)), None)
    if found is None:
        raise CheckpointError(f"no checkpoint storage serves a {type(model).__name__}: {[s.name for s in STORAGES]}")
    return found


@contextlib.contextmanager
def reading(folder: Path) -> Iterator[None]:
    """A storage's file missing while ``folder`` is read whole (a dangling link, a file removed): a CheckpointError."""
    try:
        yield
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{str(folder)!r} is not a complete checkpoint folder: {str(exc.filename or exc)!r} is missing. Give a "
            "step-N folder a Checkpointer wrote, or the folder it saved into (its latest step is read)."
        ) from exc


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a real folder that some storage holds completely."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    return any(s.is_complete(path) for s in STORAGES)


def recorded_step_of(folder: Path) -> int | None:
    """The step a checkpoint's own files record (its storage's), or ``None``.

    A Checkpointer writes it into every checkpoint; a folder without it was not written by one.
    """
    storage = storage_of(folder)
    return None if storage is None else storage.recorded_step(folder)


@dataclass(frozen=True, order=True)
class Found:
    step: int
    path: Path


def complete_checkpoints(folder: Path, *, warn: bool = True) -> list[Found]:
    """The complete checkpoints in ``folder``, oldest step first.

    Entries named like checkpoints that are not (``step-99999999999999999999``, ``step-5``,
    a symlink, a file, a folder missing a file) are skipped with one warning listing them.
    """
    found: dict[int, Found] = {}
    asides: dict[int, Path] = {}
    ignored: list[str] = []
    for entry in _entries(folder):
        name = entry.name
        step = parse_step(name)
        if step is not None and is_complete(entry):
            found[step] = Found(step, entry)
        elif step is not None or name.startswith(PREFIX):
            ignored.append(name)
        else:
            aside_step = parse_aside(name)
            if aside_step is not None and written_for(entry, aside_step):
                asides[aside_step] = entry
    for step, path in asides.items():
        found.setdefault(step, Found(step, path))
    if ignored and warn:
        shown = ", ".join(sorted(ignored)[:5]) + (f" (+{len(ignored) - 5} more)" if len(ignored) > 5 else "")
        held = " or ".join(" and ".join(s.files) for s in STORAGES)
        warnings.warn(
            f"ignoring {len(ignored)} entries of {str(folder)!r} that are not complete checkpoints: {shown}. "
            f"Checkpoint folders are named {PREFIX}NNNNNNNN and hold {STATE_FILE} and the files of one storage "
            f"({held}).",
            RuntimeWarning,
            stacklevel=3,
        )
    return sorted(found.values())


def find_latest(folder: str | os.PathLike[str]) -> Path | None:
    """The complete ``step-N`` checkpoint folder with the highest N in ``folder``, or ``None``.

    Temporary folders of interrupted saves are never returned.

    Example:
        >>> find_latest("/nonexistent") is None
        True
    """
    complete = complete_checkpoints(Path(folder))
    return complete[-1].path if complete else None


def recover_asides(folder: Path) -> list[Path]:
    """Put back steps whose replacement was interrupted; drop asides whose step is complete again.

    Call only while holding the folder's lock (:func:`~multigpu.checkpoint.atomic.folder_lock`).

    Returns:
        The step folders restored.
    """
    restored = []
    for entry in _entries(folder):
        step = parse_aside(entry.name)
        if step is None:
            continue
        final = entry.with_name(folder_name(step))
        if is_complete(final):
            remove_tree(entry)  # the replacement finished; this is the old copy
        elif not os.path.lexists(final) and written_for(entry, step):
            os.rename(entry, final)
            restored.append(final)
        # else: something else sits under the step's name; leave both alone
    return restored


def check_replaceable(target: Path) -> None:
    """Refuse to save over ``target`` (a ``step-N`` path) unless it is absent or a checkpoint of step N a Checkpointer wrote.

    A re-save replaces the step's folder whole; a folder of that name that a Checkpointer did not
    write (someone's files, a foreign or incomplete checkpoint), a file or a link would be lost.

    Raises:
        CheckpointError: naming the entry, what it is, and the fix.
    """
    step = parse_step(target.name)
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    if step is not None and written_for(target, step):
        return
    if stat.S_ISLNK(mode):
        what = "a symbolic link"
    elif not stat.S_ISDIR(mode):
        what = "not a folder"
    elif is_complete(target):
        what = "a checkpoint no Checkpointer wrote for this step (its files do not record it)"
    else:
        what = "a folder without a complete checkpoint"
    raise CheckpointError(
        f"cannot save step {step}: {str(target)!r} exists and is {what}; saving would replace it and lose what "
        "it holds. Move it away (or delete it if it is not needed), or save into another folder."
    )


def written_for(path: Path, step: int) -> bool:
    """Whether ``path`` is a complete checkpoint a Checkpointer wrote for ``step``: its files record it (a header read)."""
    return is_complete(path) and recorded_step_of(path) == step


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
