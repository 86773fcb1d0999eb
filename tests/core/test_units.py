"""One formatter per quantity (multigpu.core.units): what the tables, planner and ckpt print."""

from __future__ import annotations

import pytest

from multigpu.core.units import format_bytes, format_ms


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (3.4 * 2**20, "3.4 MiB"),
        (24.7 * 2**30, "24.7 GiB"),
        (2048 * 2**30, "2048.0 GiB"),  # GiB is the largest unit
        (-1536, "-1.5 KiB"),  # a difference keeps its sign and takes its magnitude's unit
    ],
)
def test_bytes_in_the_largest_binary_unit_that_keeps_a_digit(nbytes: float, text: str) -> None:
    assert format_bytes(nbytes) == text


def test_times_in_milliseconds() -> None:
    assert format_ms(0.0123) == "12.30 ms"
    assert format_ms(0.0123, digits=1) == "12.3 ms"
    assert format_ms(1.5, unit="") == "1500.00"
