"""Numbers a person reads: bytes in binary units, times in milliseconds.

One formatter per quantity, so the profiler's tables, the planner's sentences and ``multigpu ckpt``
print a size or a time the same way.

Example:
    >>> format_bytes(1536), format_bytes(3 * 2**30), format_ms(0.0123)
    ('1.5 KiB', '3.0 GiB', '12.30 ms')
"""

from __future__ import annotations

_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def binary_unit(nbytes: float) -> tuple[str, int]:
    """The largest binary unit (name, bytes), up to GiB, that keeps a digit before the point: a column's unit."""
    return next((name, size) for name, size in _BINARY if abs(nbytes) >= size or size == 1)


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit (up to GiB) that keeps a digit before the point.

    Args:
        nbytes: a size in bytes (negative: a difference, formatted by its magnitude).

    Returns:
        Whole bytes below 1 KiB (``'512 B'``), else one decimal (``'3.4 MiB'``, ``'24.7 GiB'``,
        ``'2048.0 GiB'``).
    """
    unit, size = binary_unit(nbytes)
    return f"{nbytes:.0f} B" if size == 1 else f"{nbytes / size:.1f} {unit}"


def format_ms(seconds: float, digits: int = 2, unit: str = " ms") -> str:
    """A time given in seconds, in milliseconds: ``format_ms(0.0123)`` is ``'12.30 ms'``.

    Args:
        seconds: the time in seconds.
        digits: decimals to keep.
        unit: what follows the number (``""`` for a table column already headed "ms").
    """
    return f"{seconds * 1e3:.{digits}f}{unit}"
