"""The order ./scripts/test hands test files to its two pytest-xdist workers: the files that start processes first.

The long files are those of multi-process tests; queued last (xdist's own order, most tests first, puts the
files of one or two long tests there), one worker ran them while the other had stopped for want of work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from tests.conftest import _processes_first
from tests.launching import ROOT


@dataclass
class _Item:
    """What the ordering reads of a pytest item: its file, and whether it is marked ``multiprocess``."""

    name: str
    path: Path
    marks: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> Any:
        return name if name in self.marks else None


def test_files_with_a_multiprocess_test_come_first_and_each_keeps_its_order() -> None:
    a, b, c = Path("tests/a.py"), Path("tests/b.py"), Path("tests/c.py")
    items = [
        _Item("a1", a),
        _Item("a2", a),
        _Item("b1", b),
        _Item("b2", b, {"multiprocess"}),  # one such test moves its whole file (xdist's unit) forward
        _Item("c1", c, {"multiprocess"}),
        _Item("c2", c),
    ]
    _processes_first(cast(list[pytest.Item], items))
    assert [item.name for item in items] == ["b1", "b2", "c1", "c2", "a1", "a2"]


def test_the_script_keeps_that_order_for_its_workers() -> None:
    """xdist reorders the files by their number of tests unless told not to: the order set above would be lost."""
    line = next(line for line in (ROOT / "scripts" / "test").read_text().splitlines() if "-m pytest" in line)
    assert "--dist loadfile" in line and "--no-loadscope-reorder" in line, line
