"""Walk nested inputs and outputs once: flatten them into leaves and a spec, rebuild from the spec.

A DataParallel step flattens its inputs (args, kwargs and targets) once and each replica's output
once, with ``torch.utils._pytree``, and works on the flat lists from there: the batch size, the
split, the device moves, the parallel backward's leaves and the gather are loops over leaves, and
the containers are rebuilt from the spec only where a structure is handed on (one per replica,
one gathered output).

What is a container: tuples, lists, dicts, namedtuples and what pytree knows already
(``OrderedDict``, ``defaultdict``, torch's return types, classes another library registered, such
as transformers' ``ModelOutput``), plus, registered here the first time one is seen: dataclasses
(their ``init`` fields, rebuilt with ``cls(**fields)``, so OrderedDict-based model-output classes
keep their class), other mappings (rebuilt with ``cls(items)``, e.g. a tokenizer's
``BatchEncoding``) and subclasses of tuple and list (``cls(items)``). Those registrations are
process-wide, as pytree's registry is. Everything else (tensors, None, numbers, strings, deques,
arbitrary objects) is a leaf.

It sits below every package that walks such structures (the engine's scatter and gather, the
memory tracker, the Session's evaluation), so none of them imports another for it.

Example:
    >>> flat = flatten(({"x": torch.ones(2)}, "note"))
    >>> flat.leaves[1], flat.path(0)
    ('note', "[0]['x']")
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

Leaf = Any

_LOCK = threading.Lock()
_IS_LEAF: dict[type, bool] = {deque: True}  # deques stay leaves, as they always were here
_DATACLASSES: set[type] = set()  # registered here: their children are named fields (paths ``.name``)
_MAPPINGS: set[type] = {dict, OrderedDict}  # context: the keys (paths ``['key']``)
_DEFAULTDICTS: set[type] = {defaultdict}  # context: the default factory and the keys
_LEAF_SPEC = pytree.tree_structure(0)  # pytree's spec of one leaf, whatever this torch names it
_node_type: Callable[[Any], Any] = pytree._get_node_type  # the registry's key (every namedtuple is `namedtuple`)


class Flat:
    """A structure's leaves, depth first, and the spec that rebuilds it.

    Args:
        leaves: the leaves in pytree order (dict insertion order, dataclass field order).
        spec: pytree's description of the containers around them.
    """

    __slots__ = ("leaves", "spec")

    def __init__(self, leaves: list[Leaf], spec: pytree.TreeSpec) -> None:
        self.leaves, self.spec = leaves, spec

    def rebuild(self, leaves: Sequence[Leaf] | None = None) -> Any:
        """The structure with ``leaves`` (default: its own) in place of its leaves."""
        return pytree.tree_unflatten(self.leaves if leaves is None else leaves, self.spec)

    def replace(self, fn: Callable[[Leaf], Any]) -> Flat:
        """The same spec with every leaf replaced by ``fn(leaf)`` (still flat)."""
        return Flat([fn(leaf) for leaf in self.leaves], self.spec)

    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensor leaves, in order."""
        return (leaf for leaf in self.leaves if isinstance(leaf, torch.Tensor))

    def child(self, index: int) -> Flat:
        """The flat form of child ``index`` of the top container (a slice of the leaves, no walk)."""
        children = _children(self.spec)
        start = sum(c.num_leaves for c in children[:index])
        return Flat(self.leaves[start : start + children[index].num_leaves], children[index])

    def path(self, index: int) -> str:
        """Where leaf ``index`` sits, as ``[0]['x'].name`` (for error messages: it walks the spec)."""
        return leaf_paths(self.spec)[index]


def flatten(obj: Any) -> Flat:
    """``obj``'s leaves and spec, registering dataclasses, mappings and sequence subclasses on first sight."""
    leaves: list[Leaf] = []
    spec = _flatten_into(obj, leaves)
    return Flat(leaves, spec)


def _flatten_into(node: Any, leaves: list[Leaf]) -> pytree.TreeSpec:
    """pytree's flatten of ``node`` (leaves appended to ``leaves``), recursing at module level.

    Why not ``pytree.tree_flatten``: its inner helper refers to itself through its closure, a reference
    cycle per call that only the garbage collector frees; a step flattens several structures, and torch's
    own DataParallel test (test_data_parallel_model_no_refcycles) asserts that a step leaves no cycle.
    """
    if _is_leaf(node):
        leaves.append(node)
        return _LEAF_SPEC
    node_type = _node_type(node)
    children, context = pytree.SUPPORTED_NODES[node_type].flatten_fn(node)
    return pytree.TreeSpec(node_type, context, [_flatten_into(child, leaves) for child in children])


def map_leaves(fn: Callable[[Leaf, str], Any], obj: Any) -> Any:
    """Rebuild ``obj`` with every leaf replaced by ``fn(leaf, path)``; path reads like ``[0]['x']``."""
    flat = flatten(obj)
    return flat.rebuild([fn(leaf, path) for leaf, path in zip(flat.leaves, leaf_paths(flat.spec))])


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor leaf of ``obj``, depth first, in the order :func:`flatten` lists them."""
    return flatten(obj).tensors()


def leaf_paths(spec: pytree.TreeSpec, prefix: str = "") -> list[str]:
    """The path of every leaf of ``spec``, in order: ``[i]`` for sequences, ``['key']`` for mappings,
    ``.name`` for dataclass fields."""
    if spec.is_leaf():
        return [prefix]
    paths: list[str] = []
    for key, child in zip(_child_keys(spec), _children(spec)):
        paths.extend(leaf_paths(child, prefix + key))
    return paths


def structure_difference(objs: Sequence[Any], path: str = "") -> str | None:
    """Where the structures of ``objs`` first differ, as a sentence (None: the same structure).

    Used only to explain a mismatch that comparing the specs found; it walks the objects.
    """
    first = objs[0]
    where = path or "the top level"
    for other in objs[1:]:
        if type(other) is not type(first) and not (_is_leaf(first) and _is_leaf(other)):
            return (
                f"replica outputs differ at {where}: {type(first).__name__} vs {type(other).__name__}; "
                "every replica must return the same structure"
            )
    if _is_leaf(first):
        return None
    levels = [_one_level(o) for o in objs]
    flat = [spec for _, spec in levels]
    for other in flat[1:]:
        if other.context != flat[0].context and flat[0].type in _MAPPINGS | _DEFAULTDICTS:
            keys = [_keys(s) for s in (flat[0], other)]
            return (
                f"replica outputs differ at {where}: keys {keys[0]} vs {keys[1]}; "
                "every replica must return the same keys"
            )
        if other.num_children != flat[0].num_children:
            return (
                f"replica outputs differ at {where}: length {flat[0].num_children} vs {other.num_children}; "
                "every replica must return the same structure"
            )
    for i, key in enumerate(_child_keys(flat[0])):
        found = structure_difference([children[i] for children, _ in levels], path + key)
        if found is not None:
            return found
    return None


def _one_level(obj: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """``obj``'s children (not flattened further) and its spec."""
    return pytree.tree_flatten(obj, is_leaf=lambda x: x is not obj)


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    # TreeSpec.children() where this torch has it; torch 2.13 deprecates the children_specs field
    children = getattr(spec, "children", None)
    return children() if callable(children) else spec.children_specs  # type: ignore[no-any-return]


def _keys(spec: pytree.TreeSpec) -> list[Any]:
    return list(spec.context[1] if spec.type in _DEFAULTDICTS else spec.context)


def _child_keys(spec: pytree.TreeSpec) -> list[str]:
    if spec.type in _MAPPINGS or spec.type in _DEFAULTDICTS:
        return [f"[{key!r}]" for key in _keys(spec)]
    if spec.type in _DATACLASSES:
        return [f".{name}" for name in spec.context]
    return [f"[{i}]" for i in range(spec.num_children)]


def _is_leaf(obj: Any) -> bool:
    """pytree's ``is_leaf`` hook, complete: True for every leaf (and for deques, which pytree would take
    apart), False for containers, registering those pytree does not know yet."""
    cls = type(obj)
    known = _IS_LEAF.get(cls)
    if known is not None:
        return known
    with _LOCK:
        leaf = _register(cls)
        _IS_LEAF[cls] = leaf
    return leaf


def _register(cls: type) -> bool:
    """Register ``cls`` with pytree when it is a container pytree does not know; whether it is a leaf."""
    make: Any = cls  # rebuilt by calling the class, whatever its constructor's declared type
    if issubclass(cls, torch.Tensor):
        return True
    if cls in pytree.SUPPORTED_NODES or (issubclass(cls, tuple) and hasattr(cls, "_fields")):  # namedtuples: pytree's
        return False
    if dataclasses.is_dataclass(cls):
        names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
        pytree.register_pytree_node(
            cls,
            lambda obj: ([getattr(obj, n) for n in names], names),
            lambda values, context: make(**dict(zip(context, values))),
            flatten_with_keys_fn=lambda obj: ([(pytree.GetAttrKey(n), getattr(obj, n)) for n in names], names),
        )
        _DATACLASSES.add(cls)
        return False
    if issubclass(cls, defaultdict):  # a subclass: rebuilt with its default factory, as pytree's own
        pytree.register_pytree_node(
            cls,
            lambda obj: (list(obj.values()), [obj.default_factory, list(obj.keys())]),
            lambda values, context: make(context[0], list(zip(context[1], values))),
        )
        _DEFAULTDICTS.add(cls)
        return False
    if issubclass(cls, Mapping):
        pytree.register_pytree_node(
            cls,
            lambda obj: (list(obj.values()), list(obj.keys())),
            lambda values, keys: make(list(zip(keys, values))),
            flatten_with_keys_fn=lambda obj: ([(pytree.MappingKey(k), v) for k, v in obj.items()], list(obj.keys())),
        )
        _MAPPINGS.add(cls)
        return False
    if issubclass(cls, (tuple, list)):
        pytree.register_pytree_node(
            cls,
            lambda obj: (list(obj), None),
            lambda values, _: make(values),
            flatten_with_keys_fn=lambda obj: ([(pytree.SequenceKey(i), v) for i, v in enumerate(obj)], None),
        )
        return False
    return True
