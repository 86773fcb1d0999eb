"""The names a Checkpointer gives its folders, parsed strictly.

A checkpoint folder is ``step-`` followed by the step as written by ``f"{step:08d}"``: eight
digits with leading zeros, more digits without one, ASCII only, the step at most
:data:`MAX_STEP`. Nothing else is a checkpoint: ``step-99999999999999999999``,
``step-5``, ``step-0000000٥`` or ``step-00000005.bak`` are someone else's folders, never read, never
pruned.

While a step is being replaced, its previous folder may sit under a hidden *aside* name,
``.step-00000005.prev-<host>-<pid>-<random>``, which discovery treats as step 5 when
``step-00000005`` is missing (see :mod:`swap`).
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from pathlib import Path

from multigpu.errors import ConfigError

MAX_STEP = 2**63 - 1  # int64, what loggers and torch store steps as
PREFIX = "step-"
ASIDE_MARKER = ".prev-"
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


def aside_name(final: Path) -> Path:
    """A hidden sibling of the step folder ``final`` that holds it while it is being replaced."""
    host = socket.gethostname().replace(".", "_")
    return final.with_name(f".{final.name}{ASIDE_MARKER}{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


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
