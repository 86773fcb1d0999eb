"""Looking a name a user typed up in a table: the entry, or a typed error naming the value, the choices and the fix.

Every table of choices multigpu keeps (device types, strategies, precisions, planner presets, options with a
few accepted values) is asked through :func:`lookup`, so a wrong name is refused the same way everywhere:
the error class the caller's layer uses, the value as typed (``repr``, so ``'fp8'`` and ``None`` differ), what
there is, and what to do.

Example:
    >>> lookup({"sgd": 1, "adam": 2}, "adam", "optimizer={value!r} is not one of {choices}; pass one of them")
    2
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from multigpu.errors import ConfigError, MultigpuError

_ASKED = object()  # shown's default: the key itself
K = TypeVar("K")
V = TypeVar("V")


def lookup(
    table: Mapping[K, V],
    key: object,
    message: str,
    *,
    error: type[MultigpuError] = ConfigError,
    choices: object = None,
    shown: object = _ASKED,
    **fields: object,
) -> V:
    """``table[key]``, or ``error(message)`` with ``message`` formatted (``str.format``) from:

    - ``{value}``: what was asked for (``shown`` when given, e.g. the name as the user typed it before it
      was normalised into ``key``); write ``{value!r}`` to quote it;
    - ``{choices}``: what there is: ``choices`` when given (a list shows as a list), else the table's keys
      joined by commas;
    - any other ``{name}`` from ``fields`` (a flag, an example), never pasted into the template itself, so
      braces in a value cannot break the message.

    Args:
        table: the choices and what each stands for.
        key: the name looked up; a key that is not hashable is simply not there.
        message: the sentence of the error: it must show ``{value`` and ``{choices}``, and should say the fix.
        error: the typed error of the caller's layer (:class:`~multigpu.errors.ConfigError`,
            :class:`~multigpu.errors.DeviceError`, ...).

    Raises:
        error: ``key`` is not in ``table``.
        ValueError: ``message`` shows neither the value nor the choices (a mistake of the caller's code).
    """
    if "{value" not in message or "{choices}" not in message:
        raise ValueError(f"lookup's message must show {{value}} and {{choices}}: {message!r}")
    try:
        if key in table:
            return table[key]  # type: ignore[index]
    except TypeError:  # unhashable: not a name of the table
        pass
    listed: Any = ", ".join(map(str, table)) if choices is None else choices
    raise error(message.format(value=key if shown is _ASKED else shown, choices=listed, **fields))
