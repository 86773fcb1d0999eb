"""The forms and bounds of numbers a user types: seconds, node counts. Torch-free, so the CLI's flags
(parsed before torch is imported) and the configs' ``__post_init__`` check the same way.

Example:
    >>> check_seconds(90, "collective_timeout_s", maximum_s=WEEK_S)
    90.0
    >>> parse_nnodes("1:4")
    (1, 4)
"""

from __future__ import annotations

import math
import os
from typing import Any

from multigpu.errors import ConfigError

DAY_S = 24 * 3600.0
WEEK_S = 7 * DAY_S


def check_seconds(value: object, name: str, *, maximum_s: float) -> float:
    """``value`` as seconds: a finite number > 0 and at most ``maximum_s`` (nan, inf, 0, negatives, text and
    booleans are refused, as is a bound past which a timer overflows or a wait never ends in practice).

    Raises:
        ConfigError: naming ``name`` with ``value`` and the range to pass.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"{name}={value!r} is not a number of seconds; pass one > 0 and at most {seconds_bound(maximum_s)}"
        )
    seconds = to_float(value)
    if not math.isfinite(seconds) or not 0 < seconds <= maximum_s:
        raise ConfigError(
            f"{name}={value!r}: pass a finite number of seconds > 0 and at most {seconds_bound(maximum_s)}, e.g. 60"
        )
    return seconds


def to_float(value: Any) -> float:
    """``float(value)``, with an int past the largest float (10**400) as the infinity of its sign instead of
    Python's OverflowError (a bound check then refuses it as not finite).

    Example:
        >>> to_float(10**400), to_float(2)
        (inf, 2.0)
    """
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def seconds_bound(maximum_s: float) -> str:
    """``604800 (7 days)``: a bound in seconds as the messages say it."""
    days = maximum_s / DAY_S
    return f"{maximum_s:g} ({days:g} day{'' if days == 1 else 's'})"


def parse_nnodes(text: str) -> tuple[int, int]:
    """A node count as torchrun takes it, ``"N"`` or ``"MIN:MAX"`` (positive, MIN <= MAX): ``(MIN, MAX)``.

    Raises:
        ConfigError: naming the text and both forms.
    """
    parts = text.split(":") if isinstance(text, str) else []
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        low, high = 0, 0
    if not 1 <= low <= high:
        raise ConfigError(
            f"nnodes={text!r}: pass a node count >= 1 (e.g. 2), or MIN:MAX with 1 <= MIN <= MAX for an elastic run "
            "(e.g. 1:4)"
        )
    return low, high


PROCESSES_PER_CORE = 4  # ranks a node may run per CPU core before the count is refused as a mistake
MIN_PROCESS_BOUND = 8  # ... and never fewer than this, so a small machine can still try a world of 8


def process_bound() -> int:
    """The most processes (or threads per process) one node may start: 4 per CPU core, and at least 8."""
    return max(MIN_PROCESS_BOUND, PROCESSES_PER_CORE * (os.cpu_count() or 1))
