"""Wrapper prefixes on state-dict keys: below both the engine and the checkpoint code.

Wrappers put their child under a name: ``nn.DataParallel`` and DDP under ``module.``,
``torch.compile`` under ``_orig_mod.``. A model may itself have a child named ``module``, so a
prefix is only removed where a wrapper put it: :func:`common_wrapper_prefix` finds the chain every
key carries (what a wrapper does), and :func:`map_keys` maps a file's keys onto a model's own keys,
reporting keys that would load into one tensor. Plain functions of strings: the engine's
state-dict hooks (:mod:`multigpu.parallel.state_keys`) and the checkpoint code
(:mod:`multigpu.checkpoint.keys`) both build on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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
