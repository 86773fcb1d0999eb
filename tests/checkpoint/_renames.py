"""Look at a folder before every rename a block makes: where a kill changes what a name points at."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def before_every_rename(look: Callable[[], None]) -> Iterator[None]:
    """Call ``look()`` just before each ``os.rename``/``os.replace`` inside the block (not inside ``look``)."""
    busy = False

    def watch(frame: object, event: str, arg: object) -> None:
        nonlocal busy
        if event == "c_call" and arg in (os.rename, os.replace) and not busy:
            busy = True
            try:
                look()
            finally:
                busy = False

    sys.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(None)
