"""The step-N folders of a Checkpointer: their names, and the files every storage's folder shares.

A checkpoint folder is named exactly ``f"step-{step:08d}"`` (ASCII digits, the step at most
:data:`MAX_STEP`); a step being replaced waits under a hidden aside name
(:func:`~multigpu.checkpoint.atomic.install_folder`). Beside its storage's files (:mod:`storages`
says which folders are checkpoints) every step folder holds ``state.pt``. Layout and rules:
docs/checkpoints.md.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from multigpu.errors import ConfigError

STATE_FILE = "state.pt"
MAX_WORLD_SIZE = 1 << 24
FIX = (
    "Resume from another step (Checkpointer.resume(path=...)), or move this folder away so that the "
    "previous step is the latest."
)

MAX_STEP = 2**63 - 1  # int64, what loggers and torch store steps as
PREFIX = "step-"
_STEP = re.compile(r"step-([0-9]{8,19})", re.ASCII)
_ASIDE = re.compile(r"\.(step-[0-9]{8,19})\.prev-.+", re.ASCII)


def folder_name(step: int) -> str:
    """The folder name of ``step``.

    Example:
        >>> folder_name(42), folder_name(123456789)
        ('step-00000042', 'step-123456789')
    """
    return f"{PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """The step a folder name stands for, or ``None`` if it is not exactly a name we write.

    Example:
        >>> parse_step("step-00000042"), parse_step("step-42"), parse_step("step-99999999999999999999")
        (42, None, None)
    """
    match = _STEP.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step <= MAX_STEP and folder_name(step) == name else None


def parse_aside(name: str) -> int | None:
    """The step of an aside folder name, or ``None``."""
    match = _ASIDE.fullmatch(name)
    return parse_step(match.group(1)) if match else None


def check_count(value: object, name: str, *, maximum: int = MAX_STEP) -> int:
    """``value`` if it is an int in ``[0, maximum]`` (a step, an epoch); else :class:`ConfigError`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be an int (got {type(value).__name__}).")
    if not 0 <= value <= maximum:
        raise ConfigError(f"{name}={value} must be between 0 and {maximum}.")
    return value


def regular_files(folder: Path, names: tuple[str, ...]) -> bool:
    try:
        return all(stat.S_ISREG(os.lstat(folder / name).st_mode) for name in names)
    except OSError:
        return False
