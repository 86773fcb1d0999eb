"""Clean state-dict keys and unwrap wrapped modules, without mistaking a child named ``module`` for a wrapper.

Wrappers put their child under a name: ``nn.DataParallel`` and DDP under ``module.``,
``torch.compile`` under ``_orig_mod.``. A checkpoint saved from a wrapper then fails to load into
the bare model (the classic "save ``model.module.state_dict()``" advice). multigpu saves the
unwrapped model's own keys, and everything that loads accepts keys with or without these
prefixes.

A model may itself have a child named ``module`` (``self.module = nn.Linear(...)``), so a
prefix is only ever removed where a wrapper put it:

* :func:`unwrap` removes wrappers it knows by type, never a model that happens to have a single
  child called ``module``;
* without a model, :func:`clean_state_dict` removes only a prefix chain that *every* key
  carries (which is what a wrapper does), so no two keys can become one;
* when loading, :func:`match_keys` maps the file's keys onto the model's own keys and refuses
  files in which several keys would land on one name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TypeVar

from torch import nn

from multigpu._keys import (  # noqa: F401 (re-exported: the checkpoint API names them)
    WRAPPER_PREFIXES,
    collision_message,
    common_wrapper_prefix,
    find_collisions,
    find_prefixes,
    map_keys,
    strip_prefixes,
)
from multigpu.errors import CheckpointError

# Wrappers, by class, so this package need not import them (they live in packages above or beside it).
_WRAPPER_CLASSES = {
    ("torch.nn.parallel.data_parallel", "DataParallel"): "module",
    ("torch.nn.parallel.distributed", "DistributedDataParallel"): "module",
    ("torch._dynamo.eval_frame", "OptimizedModule"): "_orig_mod",
}

V = TypeVar("V")


def clean_state_dict(state_dict: Mapping[str, V]) -> OrderedDict[str, V]:
    """A copy of ``state_dict`` without the wrapper prefix chain that every key carries.

    Only a prefix shared by all keys is removed, so no two keys collapse into one: a model with
    a child named ``module`` next to other children keeps its keys.

    Example:
        >>> list(clean_state_dict({"module._orig_mod.fc.weight": 1}))
        ['fc.weight']
        >>> list(clean_state_dict({"module.weight": 1, "head.weight": 2}))
        ['module.weight', 'head.weight']
    """
    prefix = common_wrapper_prefix(state_dict)
    return OrderedDict((k[len(prefix) :], v) for k, v in state_dict.items())


def match_keys(found: Iterable[str], expected: Iterable[str], *, source: str = "the state dict") -> dict[str, str]:
    """Map the file's keys onto the model's: file key -> model key, for every key that matches.

    See :func:`multigpu._keys.map_keys` for the rule (the wrapper chain shared by all keys first,
    then per key, never two file keys onto one model key).

    Raises:
        CheckpointError: several file keys would load into one model key (listed).

    Example:
        >>> match_keys(["module.module.weight", "module.weight"], ["module.weight", "weight"])
        {'module.module.weight': 'module.weight', 'module.weight': 'weight'}
    """
    mapping, collisions = map_keys(found, expected)
    if collisions:
        raise CheckpointError(collision_message(source, collisions))
    return mapping


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module inside any nesting of DataParallel, DDP and torch.compile wrappers.

    Wrappers are recognised by type (torch's ``DataParallel``, ``DistributedDataParallel``,
    ``torch.compile``'s module, multigpu's ``DataParallel``), so a model whose only child is
    named ``module`` is not mistaken for one.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> unwrap(nn.DataParallel(net)) is net
        True
    """
    while True:
        attribute = _wrapped_attribute(model)
        inner = getattr(model, attribute, None) if attribute else None
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _wrapped_attribute(model: nn.Module) -> str | None:
    for cls in type(model).__mro__:
        found = _WRAPPER_CLASSES.get((cls.__module__, cls.__qualname__))
        if found:
            return found
        if cls.__qualname__ == "DataParallel" and cls.__module__.startswith("multigpu."):
            return "module"
    return None
