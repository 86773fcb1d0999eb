"""State-dict key prefixes: the one place that knows what wrappers add to a model's keys.

Wrappers put their child under a name: ``nn.DataParallel`` and DDP under ``module.``,
``torch.compile`` under ``_orig_mod.``. A checkpoint saved from a wrapper then fails to load into
the bare model (the classic "save ``model.module.state_dict()``" advice). multigpu saves the
unwrapped model's own keys, and everything that loads accepts keys with or without these
prefixes: the checkpoint code (:mod:`multigpu.checkpoint`) and DataParallel's state-dict hooks
(:func:`drop_module_prefix`, :func:`add_module_prefix`) both use the functions here.

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
from typing import Any, TypeVar

from torch import nn

from multigpu.errors import CheckpointError

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SHOWN = 6  # colliding keys listed in a message


def strip_prefixes(key: str) -> str:
    """``key`` without any leading wrapper prefixes (``module.``, ``_orig_mod.``), however nested.

    It looks at one key only, so it cannot tell a wrapper's ``module.`` from a child named
    ``module``; prefer :func:`clean_state_dict` or :func:`match_keys`, which see all keys.
    """
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                changed = True
    return key


def common_wrapper_prefix(keys: Iterable[str]) -> str:
    """The chain of wrapper prefixes that every key starts with (``""`` when none or no keys).

    Example:
        >>> common_wrapper_prefix(["module._orig_mod.a", "module.b"])
        'module.'
    """
    common: str | None = None
    for key in keys:
        chain = key[: len(key) - len(strip_prefixes(key))]
        if common is None:
            common = chain
            continue
        while not chain.startswith(common):
            common = _drop_last_prefix(common)
        if not common:
            return ""
    return common or ""


def _drop_last_prefix(chain: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        if chain.endswith(prefix):
            return chain[: -len(prefix)]
    return ""


def find_collisions(keys: Iterable[str]) -> dict[str, list[str]]:
    """Keys that become the same name once wrapper prefixes are stripped from each: name -> keys.

    Example:
        >>> find_collisions(["module.weight", "_orig_mod.weight", "weight", "bias"])
        {'weight': ['module.weight', '_orig_mod.weight', 'weight']}
    """
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(strip_prefixes(key), []).append(key)
    return {name: found for name, found in groups.items() if len(found) > 1}


def collision_message(source: str, collisions: Mapping[str, list[str]]) -> str:
    """What to say about keys that would load into one tensor (``collisions`` from :func:`map_keys`)."""
    shown = "; ".join(f"{', '.join(keys)} -> {name}" for name, keys in list(collisions.items())[:_SHOWN])
    more = f" (+{len(collisions) - _SHOWN} more)" if len(collisions) > _SHOWN else ""
    return (
        f"{source} has keys that differ only by wrapper prefixes and would load into one tensor: "
        f"{shown}{more}. It is ambiguous which one is meant; fix the file (keep one key per tensor) "
        "or load with strip= naming the prefix to remove."
    )


def map_keys(found: Iterable[str], expected: Iterable[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Map the file's keys onto the model's: file key -> model key, for every key that matches.

    A key matches as it is, or after removing the wrapper chain shared by all of the file's keys
    (and adding the one shared by all of the model's keys). A file key that still matches
    nothing may lose its own wrapper prefixes, but only onto a model key no other file key took.

    Returns:
        ``(mapping, collisions)``: file key -> model key for every key that matches, and, for each
        model key that several file keys would load into, those keys (for the caller to refuse).

    Example:
        >>> map_keys(["module.module.weight", "module.weight"], ["module.weight", "weight"])[0]
        {'module.module.weight': 'module.weight', 'module.weight': 'weight'}
    """
    found, expected_set = list(found), set(expected)
    mapping = _best_uniform_mapping(found, expected_set)
    taken: dict[str, list[str]] = {}
    for key, target in mapping.items():
        taken.setdefault(target, []).append(key)
    for key in found:
        if key in mapping:
            continue
        bare = strip_prefixes(key)
        for target in (bare, common_wrapper_prefix(expected_set) + bare):
            if target in expected_set:
                taken.setdefault(target, []).append(key)
                mapping[key] = target
                break
    collisions = {target: keys for target, keys in taken.items() if len(keys) > 1}
    return mapping, collisions


def _best_uniform_mapping(found: list[str], expected: set[str]) -> dict[str, str]:
    # Candidates: strip 0..all levels of the file's shared chain, add 0 or all of the model's.
    file_chain, model_chain = common_wrapper_prefix(found), common_wrapper_prefix(expected)
    strips = [file_chain]
    while strips[-1]:
        strips.append(_drop_last_prefix(strips[-1]))
    best: dict[str, str] = {}
    for strip in reversed(strips):  # the shortest change first: it wins ties
        for add in ("", model_chain) if model_chain else ("",):
            mapped = {k: add + k[len(strip) :] for k in found}
            hits = {k: t for k, t in mapped.items() if t in expected}
            if len(hits) > len(best):
                best = hits
    return best


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


# Wrappers, recognised by class name so that this module imports none of them (torch.compile, DDP).
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

    See :func:`map_keys` for the rule (the wrapper chain shared by all keys first,
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


# --- DataParallel's state-dict hooks: save the bare model's keys, load bare or wrapped ones -------------


def drop_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """state_dict hook: save the wrapped module's keys without the ``module.`` segment."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def add_module_prefix(wrapper: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: accept bare, ``module.`` and ``_orig_mod.`` keys alike.

    Raises:
        CheckpointError: several keys name the same tensor of the model (``weight`` and
            ``module.weight``), listing them.
    """
    own = [k for k in state_dict if k.startswith(prefix)]
    inner: nn.Module = wrapper.module  # type: ignore[assignment]
    mapping = match_keys([k[len(prefix) :] for k in own], inner.state_dict().keys())
    values = {key: state_dict.pop(key) for key in own}  # all out first: a new key may equal an old one
    for key, value in values.items():
        local = key[len(prefix) :]
        state_dict[prefix + "module." + mapping.get(local, local)] = value
