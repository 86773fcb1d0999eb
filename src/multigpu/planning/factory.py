"""A user's model by import path (``package.module:factory``), built where it costs nothing.

For a GPU plan the factory runs under ``torch.device("meta")``: every tensor it creates has a
shape and no data, so a billion-parameter model is built and counted in seconds without memory.
For a plan on this CPU the model is built for real and timed at a small probe batch
(:data:`PROBE_BATCH` samples at most); compute scales linearly from there. The current folder is
searched first, so ``multigpu advise --model mynet:build`` finds ``./mynet.py``.

Example:
    >>> model = build("torch.nn:Identity", meta=True)
    >>> type(model).__name__
    'Identity'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from multigpu.core.script import importable_from
from multigpu.errors import ConfigError

PROBE_BATCH = 8  # samples per replica timed on this CPU; larger batches are scaled, never run
INPUT_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "long": torch.long,
    "int64": torch.long,
}


def load_factory(path: str) -> Callable[[], object]:
    """The callable at ``package.module:attribute``, importable from the current folder too.

    Raises:
        ConfigError: no ``:``, a module or attribute that does not import (the message says which).
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        from multigpu.planning.models import PRESETS

        raise ConfigError(f"--model {path!r} is neither a preset ({', '.join(PRESETS)}) nor 'package.module:factory'")
    try:
        with importable_from():  # console scripts do not put the current folder on the path
            factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model {path!r}: cannot import {attr!r} from {module_name!r} ({exc})") from exc
    if not callable(factory):
        raise ConfigError(f"--model {path!r} names a {type(factory).__name__}, not a function that builds a model")
    return factory  # type: ignore[no-any-return]


def build(path: str, *, meta: bool) -> nn.Module:
    """Call the factory at ``path`` (on the meta device when ``meta``) and check it built a module."""
    factory = load_factory(path)
    try:
        if meta:
            with torch.device("meta"):
                made = factory()
        else:
            made = factory()
    except Exception as exc:  # the user's code: any failure becomes one clear line
        where = (
            " on the meta device (a GPU plan builds it without data; plan on this CPU to build it for real)"
            if meta
            else ""
        )
        raise ConfigError(f"--model {path!r}: the factory raised {type(exc).__name__}: {exc}{where}") from exc
    if not isinstance(made, nn.Module):
        raise ConfigError(f"--model {path!r} returned {type(made).__name__}, not an nn.Module")
    return made


def parse_shape(text: str | None, *, flag: str = "--input-shape") -> tuple[int, ...] | None:
    """``"3,224,224"`` -> ``(3, 224, 224)``; None stays None (also for device counts and chunk sizes).

    Raises:
        ConfigError: a part that is not a positive integer.
    """
    if text is None:
        return None
    try:
        shape = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise ConfigError(f"{flag} {text!r} must be positive integers separated by commas, e.g. 512 or 3,224,224")
    return shape


def sample_inputs(batch: int, shape: Sequence[int], dtype: str, device: torch.device | str) -> torch.Tensor:
    """A batch of ``batch`` samples of ``shape``: random floats, or token ids 0 (valid for any vocabulary).

    Raises:
        ConfigError: an unknown dtype.
    """
    if dtype not in INPUT_DTYPES:
        raise ConfigError(f"--input-dtype {dtype!r} is not one of {', '.join(INPUT_DTYPES)}")
    kind = INPUT_DTYPES[dtype]
    if kind.is_floating_point:
        return torch.randn(batch, *shape, dtype=kind, device=device)
    return torch.zeros(batch, *shape, dtype=kind, device=device)
