"""This test process posing as one rank of a ``multigpu launch`` run: its failure folder and a fresh ledger."""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator
from pathlib import Path

import pytest

from multigpu.runtime import tracking


def launched_as(rank: int, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Rank ``rank`` of 2 with ``folder`` as its failure folder, for a fixture to yield from; closes the
    stack file the ledger opened."""
    monkeypatch.setenv("MULTIGPU_FAILURE_DIR", str(folder))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(tracking, "_ledger", tracking._Ledger())
    yield folder
    if tracking._stack_file is not None:
        faulthandler.unregister(tracking.STACK_SIGNAL)
        tracking._stack_file.close()
        tracking._stack_file = None
