"""argparse types for the numbers the subcommands take: whole counts in a range, seconds, finite reals.

Each refuses nan, inf, negatives and text where the flag has no use for them, with a message that
names the value and the range (argparse prefixes the flag and exits with code 2), before torch is
imported. The bounds a value must keep are the library's (:mod:`multigpu.core.limits`).

Example:
    >>> count(1, 10, "a step count")("3")
    3
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from multigpu.core.limits import seconds_bound


def count(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """A whole number from ``low`` to ``high`` (None: no upper bound); ``what`` names it in the message."""

    def parse(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            span = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{text!r}: pass {what}, a whole number {span}")
        return value

    return parse


def seconds(maximum_s: float) -> Callable[[str], float]:
    """Seconds: finite, > 0 and at most ``maximum_s``."""

    def parse(text: str) -> float:
        value = _float(text)
        if not (math.isfinite(value) and 0 < value <= maximum_s):  # nan, inf, 0, negatives, text
            raise argparse.ArgumentTypeError(
                f"{text!r}: pass a finite number of seconds > 0 and at most {seconds_bound(maximum_s)}, e.g. 60"
            )
        return value

    return parse


def real(low: float, high: float | None, what: str, *, low_open: bool = True) -> Callable[[str], float]:
    """A finite number above ``low`` (or from it, ``low_open=False``) and up to ``high`` (None: no bound)."""

    def parse(text: str) -> float:
        value = _float(text)
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and (high is None or value <= high)):
            span = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{text!r}: pass {what}, a finite number {span}")
        return value

    return parse


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan
