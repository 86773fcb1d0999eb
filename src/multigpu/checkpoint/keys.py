"""Clean state-dict keys and unwrap wrapped modules.

Wrappers put their child under a name: ``nn.DataParallel`` and DDP under ``module.``,
``torch.compile`` under ``_orig_mod.``. A checkpoint saved from a wrapper then fails to load into
the bare model (the classic "save ``model.module.state_dict()``" advice). multigpu's wrappers
save bare keys, and everything that loads accepts keys with or without these prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from torch import nn

from multigpu._keys import WRAPPER_PREFIXES, strip_prefixes  # noqa: F401 (WRAPPER_PREFIXES: re-exported)

V = TypeVar("V")


def clean_state_dict(state_dict: Mapping[str, V]) -> OrderedDict[str, V]:
    """A copy of ``state_dict`` whose keys carry no wrapper prefix.

    Example:
        >>> list(clean_state_dict({"module._orig_mod.fc.weight": 1}))
        ['fc.weight']
    """
    return OrderedDict((strip_prefixes(k), v) for k, v in state_dict.items())


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module inside any nesting of DataParallel, DDP and torch.compile wrappers.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> unwrap(nn.DataParallel(net)) is net
        True
    """
    while True:
        inner: Any = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and _is_wrapper(model):
            model = inner
            continue
        return model


def _is_wrapper(model: nn.Module) -> bool:
    # A wrapper registers exactly one child, under "module" (DataParallel, DDP, multigpu's DataParallel).
    return list(model._modules) == ["module"]


def find_prefixes(keys: Iterable[str]) -> dict[str, int]:
    """How many ``keys`` start with each wrapper prefix chain (``"module."``, ``"module._orig_mod."``).

    Example:
        >>> find_prefixes(["module.fc.weight", "module.fc.bias", "head.bias"])
        {'module.': 2}
    """
    counts: dict[str, int] = {}
    for key in keys:
        prefix = key[: len(key) - len(strip_prefixes(key))]
        if prefix:
            counts[prefix] = counts.get(prefix, 0) + 1
    return counts
