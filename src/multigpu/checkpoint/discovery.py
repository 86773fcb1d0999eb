"""Find the complete checkpoints in a Checkpointer folder, ignoring (with a warning) what is not one.

A checkpoint is complete when its folder has a strict step name (see :mod:`naming`), is a real
folder (not a symlink), and holds its files as regular files: ``model.safetensors`` and
``state.pt``, or, for a sharded checkpoint (fsdp, :mod:`dcp_files`), ``manifest.json``, DCP's
``.metadata`` and ``state.pt``. Every file is written before the folder gets its name, so present
means whole. A step whose folder is missing but
whose previous copy sits under an aside name (a replacement was interrupted) is found there,
if that copy's weights header records the same step.
"""

from __future__ import annotations

import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path

from multigpu.checkpoint.atomic import remove_tree
from multigpu.checkpoint.dcp_files import MANIFEST_FILE, METADATA_FILE, recorded_step
from multigpu.checkpoint.naming import ASIDE_MARKER, PREFIX, parse_aside, parse_step
from multigpu.checkpoint.safetensors_header import read_header
from multigpu.errors import CheckpointError

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"


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
            if aside_step is not None and _is_aside_of(entry, aside_step):
                asides[aside_step] = entry
    for step, path in asides.items():
        found.setdefault(step, Found(step, path))
    if ignored and warn:
        shown = ", ".join(sorted(ignored)[:5]) + (f" (+{len(ignored) - 5} more)" if len(ignored) > 5 else "")
        warnings.warn(
            f"ignoring {len(ignored)} entries of {str(folder)!r} that are not complete checkpoints: {shown}. "
            f"Checkpoint folders are named {PREFIX}NNNNNNNN and hold {MODEL_FILE} (or, sharded, {MANIFEST_FILE} "
            f"and {METADATA_FILE}) and {STATE_FILE}.",
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


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a real folder holding a checkpoint's files as regular files (either format)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    return _regular_files(path, (MODEL_FILE, STATE_FILE)) or _regular_files(
        path, (MANIFEST_FILE, METADATA_FILE, STATE_FILE)
    )


def _regular_files(folder: Path, names: tuple[str, ...]) -> bool:
    try:
        return all(stat.S_ISREG(os.lstat(folder / name).st_mode) for name in names)
    except OSError:
        return False


def recorded_step_of(folder: Path) -> int | None:
    """The step a checkpoint's own files record (weights header or manifest), or ``None``.

    A Checkpointer writes it into every checkpoint; a folder without it was not written by one.
    """
    if (folder / MANIFEST_FILE).is_file():
        return recorded_step(folder)
    try:
        text = read_header(folder / MODEL_FILE).metadata.get("step")
    except (CheckpointError, OSError):
        return None
    if text is None or not (text.isascii() and text.isdigit()) or str(int(text)) != text:
        return None
    return int(text)


def recover_asides(folder: Path) -> list[Path]:
    """Put back steps whose replacement was interrupted; drop asides whose step is complete again.

    Call only while holding the folder's lock (see :mod:`lock`).

    Returns:
        The step folders restored.
    """
    restored = []
    for entry in _entries(folder):
        step = parse_aside(entry.name)
        if step is None:
            continue
        final = entry.with_name(entry.name[1:].split(ASIDE_MARKER, 1)[0])
        if is_complete(final):
            remove_tree(entry)  # the replacement finished; this is the old copy
        elif not os.path.lexists(final) and _is_aside_of(entry, step):
            os.rename(entry, final)
            restored.append(final)
        # else: something else sits under the step's name; leave both alone
    return restored


def _is_aside_of(path: Path, step: int) -> bool:
    # Hidden entries are ours only if complete and their weights record the step (a cheap header read).
    return is_complete(path) and recorded_step_of(path) == step


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
