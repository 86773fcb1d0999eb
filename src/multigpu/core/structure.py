"""Walk nested inputs and outputs: tuples, lists, dicts, namedtuples and dataclasses.

Scatter and gather both need "do this to every leaf, keep the containers". Containers are
rebuilt with their own type, so a namedtuple stays a namedtuple and a dataclass (including
OrderedDict-based model-output classes such as transformers' ``ModelOutput``) keeps its class.
Anything else (tensors, None, ints, strings, arbitrary objects) is a leaf.

It sits below every package that walks such structures (the engine's scatter and gather, the
memory tracker, the Session's evaluation), so none of them imports another for it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from multigpu.errors import GatherError

Leaf = Any


def map_leaves(fn: Callable[[Leaf, str], Any], obj: Any, path: str = "") -> Any:
    """Rebuild ``obj`` with every leaf replaced by ``fn(leaf, path)``; path reads like ``[0]['x']``."""
    return zip_leaves(lambda leaves, p: fn(leaves[0], p), [obj], path)


def zip_leaves(fn: Callable[[list[Leaf], str], Any], objs: Sequence[Any], path: str = "") -> Any:
    """Rebuild the common structure of ``objs``, each leaf position becoming ``fn([leaves...], path)``.

    Raises:
        GatherError: the structures differ (types, lengths or keys), naming where.
    """
    first = objs[0]
    kind = _kind(first)
    if kind == "leaf":
        return fn(list(objs), path)
    for other in objs[1:]:
        if type(other) is not type(first):
            raise GatherError(
                f"replica outputs differ at {path or 'the top level'}: {type(first).__name__} "
                f"vs {type(other).__name__}; every replica must return the same structure"
            )
    if kind == "dataclass":
        names = [f.name for f in dataclasses.fields(first) if f.init]
        values = {n: zip_leaves(fn, [getattr(o, n) for o in objs], f"{path}.{n}") for n in names}
        return type(first)(**values)
    if kind == "mapping":
        keys = list(first.keys())
        for other in objs[1:]:
            if list(other.keys()) != keys:
                raise GatherError(
                    f"replica outputs differ at {path or 'the top level'}: keys {keys} vs "
                    f"{list(other.keys())}; every replica must return the same keys"
                )
        items = [(k, zip_leaves(fn, [o[k] for o in objs], f"{path}[{k!r}]")) for k in keys]
        if isinstance(first, defaultdict):
            return type(first)(first.default_factory, items)
        return type(first)(items)
    length = len(first)
    for other in objs[1:]:
        if len(other) != length:
            raise GatherError(
                f"replica outputs differ at {path or 'the top level'}: length {length} vs "
                f"{len(other)}; every replica must return the same structure"
            )
    items = [zip_leaves(fn, [o[i] for o in objs], f"{path}[{i}]") for i in range(length)]
    if kind == "namedtuple":
        return type(first)(*items)
    return type(first)(items)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor leaf of ``obj``, depth first, in the order :func:`map_leaves` visits them."""
    kind = _kind(obj)
    if kind == "leaf":
        if isinstance(obj, torch.Tensor):
            yield obj
        return
    if kind == "dataclass":
        children: list[Any] = [getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init]
    elif kind == "mapping":
        children = list(obj.values())
    else:
        children = list(obj)
    for child in children:
        yield from iter_tensors(child)


def _kind(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return "leaf"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return "dataclass"
    if isinstance(obj, Mapping):
        return "mapping"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return "namedtuple"
    if isinstance(obj, (tuple, list)):
        return "sequence"
    return "leaf"
