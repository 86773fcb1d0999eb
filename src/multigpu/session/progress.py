"""A progress bar over a loop's batches, drawn by the main process only (rich).

Example:
    >>> for batch in with_progress(range(3), total=3, description="epoch"):  # doctest: +SKIP
    ...     pass
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

T = TypeVar("T")


def with_progress(items: Iterator[T], *, total: int | None, description: str = "batches") -> Iterator[T]:
    """Yield ``items`` while a bar counts them (``total`` None: a count without an end)."""
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    if total is not None:
        columns.append(TimeRemainingColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
