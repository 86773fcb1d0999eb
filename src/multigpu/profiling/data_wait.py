"""The time a step waits for its next batch: the ``data wait`` phase of the step profiler.

A slow loader (decoding, disk, too few workers) shows up in a profile as time outside every phase
("other") unless it is measured. :func:`timing_data_waits` times each ``next()`` on a
``torch.utils.data.DataLoader`` iterator inside the block and reports it to a phase listener as
:data:`DATA_WAIT` (charged to the primary device): a loader that sleeps 20 ms per batch shows about
20 ms there. DataLoader has no hook for this, so the iterator's ``__next__`` is wrapped for the
block's duration and put back after; iterators of other kinds (plain lists, generators) are not seen.

Example:
    >>> with timing_data_waits(profiler):   # doctest: +SKIP
    ...     for x, y in loader: ...
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from torch.utils.data.dataloader import _BaseDataLoaderIter

from multigpu.core.listeners import PhaseListener

DATA_WAIT = "data wait"

_lock = threading.Lock()


@contextlib.contextmanager
def timing_data_waits(listener: PhaseListener) -> Iterator[None]:
    """Report every DataLoader ``next()`` inside the block to ``listener`` as the phase :data:`DATA_WAIT`.

    Blocks may nest (the inner one exits first); each hears the waits inside it.
    """
    with _lock:
        inner = _BaseDataLoaderIter.__next__

        def timed(self: Any) -> Any:
            token = listener.begin(DATA_WAIT, None)
            try:
                return inner(self)
            finally:
                listener.end(token, 0)

        _BaseDataLoaderIter.__next__ = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        with _lock:
            if _BaseDataLoaderIter.__next__ is timed:
                _BaseDataLoaderIter.__next__ = inner  # type: ignore[method-assign]
