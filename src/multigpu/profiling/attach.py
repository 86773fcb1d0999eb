"""Attach a profiler to the engines it measures, for the duration of a block.

An engine (``multigpu.DataParallel``) reports its phases and replica scopes only to listeners
attached to it (:mod:`multigpu.core.listeners`). :func:`attached` does the attaching:

- given a model, to every engine inside it (the model itself, a DataParallel nested in it, a
  teacher held as a submodule): each module with an ``add_listener`` method;
- given no model (``multigpu profile script.py`` cannot see the script's model), to every engine
  that is *called* inside the block: torch's global forward pre-hook
  (``register_module_forward_pre_hook``) sees each module call, and the first call of an engine
  attaches the listener before the engine runs its step. The hook is removed at the block's end.

Every attachment is undone when the block ends, also when it raises. The profiler never imports
the engine: engines are recognised by their ``add_listener`` method.

Example:
    >>> with attached(profiler, model):      # doctest: +SKIP
    ...     model(x)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook


@contextlib.contextmanager
def attached(listener: Any, model: nn.Module | None = None) -> Iterator[None]:
    """Attach ``listener`` to the engines of ``model`` (None: of every engine called) inside the block.

    Args:
        listener: what the engines report to (see :mod:`multigpu.core.listeners`).
        model: the model to measure; None discovers engines as they are called.
    """
    handles: list[Any] = []
    try:
        if model is not None:
            engines = [module for module in model.modules() if _is_engine(type(module))]
            handles += [engine.add_listener(listener) for engine in engines]  # type: ignore[operator]  # an engine's method
            yield
            return
        with _attach_when_called(listener, handles):
            yield
    finally:
        for handle in reversed(handles):
            handle.remove()


@contextlib.contextmanager
def _attach_when_called(listener: Any, handles: list[Any]) -> Iterator[None]:
    seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    engine_types: dict[type, bool] = {}

    def on_call(module: nn.Module, _args: Any) -> None:
        kind = type(module)
        is_engine = engine_types.get(kind)
        if is_engine is None:  # one attribute lookup per module class, not per call
            is_engine = engine_types[kind] = _is_engine(kind)
        if is_engine and module not in seen:
            seen.add(module)
            handles.append(module.add_listener(listener))  # type: ignore[operator]  # checked by _is_engine

    hook = register_module_forward_pre_hook(on_call)
    try:
        yield
    finally:
        hook.remove()


def _is_engine(kind: type) -> bool:
    return callable(getattr(kind, "add_listener", None))
