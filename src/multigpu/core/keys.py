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
  files in which several keys would land on one name; :func:`plan_load` checks the tensors against
  the model (every key and shape, or what loads with ``strict=False``) and names the likely cause of
  a mismatch (:func:`describe_mismatch`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from multigpu.errors import CheckpointError, ConfigError

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SHOWN = 6  # keys listed in a message: colliding ones, or each kind of mismatch


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
    for key in state_dict:
        if not isinstance(key, str):
            raise ConfigError(
                f"the state dict has an entry under the key {key!r} of type {type(key).__name__}; a state dict's keys "
                "are strings (a module's names): use str(key) or the parameter's name"
            )
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


# --- a state dict against a model: what loads, and what differs ---


def plan_load(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    strip: str | Sequence[str] = (),
    source: str = "the state dict",
) -> dict[str, torch.Tensor]:
    """The tensors to load into the bare model, by its keys; checks everything, changes nothing.

    Raises:
        CheckpointError: keys collide, or (``strict``) keys or shapes differ.
    """
    bare = unwrap(model)
    found = _strip_extra(tensors, strip, source)
    expected = bare.state_dict()
    mapping = match_keys(found, expected, source=source)
    renamed = OrderedDict((mapping.get(k, k), v) for k, v in found.items())
    problem = describe_mismatch(expected, renamed)
    if problem and strict:
        raise CheckpointError(f"{source} does not match {type(bare).__name__}: {problem}")
    for key, value in renamed.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{source}: {key!r} is a {type(value).__name__}, not a tensor.")
    return {k: v for k, v in renamed.items() if k in expected and v.shape == expected[k].shape}


def describe_mismatch(expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor]) -> str:
    """Missing, unexpected and shape-different keys with the likely cause; ``""`` when they match."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    shapes = [
        f"{k}: file {tuple(found[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in found and found[k].shape != expected[k].shape
    ]
    if not (missing or unexpected or shapes):
        return ""
    parts = [
        _listing("missing", missing),
        _listing("unexpected", unexpected),
        _listing("shape differs", shapes),
    ]
    listing = "; ".join(p for p in parts if p)
    return f"{listing}. Likely cause: {_likely_cause(list(expected), list(found), missing, unexpected, shapes)}"


def _listing(label: str, items: list[str]) -> str:
    if not items:
        return ""
    more = f" (+{len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return f"{len(items)} {label}: {', '.join(items[:_SHOWN])}{more}"


def _likely_cause(
    expected: list[str], found: list[str], missing: list[str], unexpected: list[str], shapes: list[str]
) -> str:
    prefix = _common_extra_prefix(found, expected)
    if prefix:
        return (
            f"the file's keys carry the prefix {prefix!r} the model does not have; load with "
            f"strip=({prefix!r},) or convert the file (multigpu ckpt convert --strip-prefix {prefix})."
        )
    prefix = _common_extra_prefix(expected, found)
    if prefix:
        return (
            f"the model's keys carry the prefix {prefix!r}: the file holds only a part of it; load "
            f"into that submodule ({prefix.rstrip('.')})."
        )
    if shapes and not missing and not unexpected:
        return "the same architecture with different sizes (e.g. another number of classes or width)."
    common = len(set(expected) & set(found))
    if common < max(1, len(expected) // 2):
        return f"a different model: only {common} of the model's {len(expected)} keys are in the file."
    return "a different version of the model (layers added, removed or renamed); strict=False loads the rest."


def _common_extra_prefix(longer: list[str], shorter: list[str]) -> str:
    # The first dotted component shared by every key of ``longer`` whose removal yields ``shorter``.
    if not longer or not shorter:
        return ""
    heads = {k.split(".", 1)[0] for k in longer}
    if len(heads) != 1 or "." not in longer[0]:
        return ""
    prefix = heads.pop() + "."
    stripped = {k[len(prefix) :] for k in longer}
    return prefix if len(stripped & set(shorter)) >= max(1, len(shorter) // 2) else ""


def key_prefixes(strip: str | Sequence[str], what: str = "strip") -> tuple[str, ...]:
    """The module-path prefixes ``strip`` names, each ending in ``.``: ``"model"`` removes ``model.``
    (never the ``model`` of ``modelx.weight``), and one string is one prefix (not its characters).

    Raises:
        ConfigError: an entry that is not a non-empty string (naming it).

    Example:
        >>> key_prefixes("model"), key_prefixes(["a.", "b"])
        (('model.',), ('a.', 'b.'))
    """
    entries: list[object]
    try:
        entries = [strip] if isinstance(strip, str) else list(strip)
    except TypeError:  # not iterable (strip=5): named below
        entries = [strip]
    example = f"{what} model." if what.startswith("--") else f"{what}=('model.',)"
    for prefix in entries:
        if not isinstance(prefix, str) or not prefix.strip("."):
            raise ConfigError(
                f"{what} holds {prefix!r}; give key prefixes as strings naming a module path, e.g. {example} "
                "to read 'model.weight' as 'weight'"
            )
    return tuple(p if p.endswith(".") else p + "." for p in entries if isinstance(p, str))


def _strip_extra(
    tensors: Mapping[str, torch.Tensor], strip: str | Sequence[str], source: str
) -> OrderedDict[str, torch.Tensor]:
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    origins: dict[str, list[str]] = {}
    strip = key_prefixes(strip)
    for original, value in tensors.items():
        key = original
        for prefix in strip:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        origins.setdefault(key, []).append(original)
        out[key] = value
    collisions = {name: keys for name, keys in origins.items() if len(keys) > 1}
    if collisions:
        raise CheckpointError(collision_message(source, collisions))
    return out
