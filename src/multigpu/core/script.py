"""Run a Python file as ``__main__`` in this process, as ``python script.py args...`` would.

Two commands run a user's script inside a process of theirs: ``multigpu profile`` (to hook the
script's steps) and every ddp worker of ``multigpu launch`` (:mod:`multigpu.launcher._entry`,
to record its exception for the launcher). Both go through :func:`run_as_main`, which sits here,
below the CLI and the launcher alike.

:func:`importable_from` puts a folder on ``sys.path`` for a block: console scripts (``multigpu``)
start with their own folder there, not the current one, so a user's module next to them
(``--model mynet:build``, the classes an unsafe pickle names) would not import otherwise.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path


def run_as_main(script: str | Path, argv: Sequence[str] = ()) -> None:
    """Run ``script`` as ``python script argv...`` would: as ``__main__``, with that ``sys.argv``
    and the script's folder first on ``sys.path``. Both are restored afterwards.

    Args:
        script: the path of the Python file.
        argv: its arguments (``sys.argv[1:]`` inside the script).

    Raises:
        Whatever the script raises, ``SystemExit`` from its ``sys.exit()`` included.

    Example:
        >>> run_as_main("train.py", ["--epochs", "1"])   # doctest: +SKIP
    """
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


@contextlib.contextmanager
def importable_from(folder: str | Path | None = None) -> Iterator[None]:
    """``folder`` (default: the current folder) first on ``sys.path`` inside the block, as
    ``python script.py`` run from there would have it; removed afterwards unless it was there before.

    Example:
        >>> with importable_from():          # doctest: +SKIP
        ...     factory = importlib.import_module("mynet").build
    """
    path = str(folder) if folder is not None else os.getcwd()
    added = path not in sys.path
    if added:
        sys.path.insert(0, path)
    try:
        yield
    finally:
        if added and path in sys.path:
            sys.path.remove(path)
