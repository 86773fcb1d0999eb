"""Wrapper prefixes on state-dict keys: below both the engine and the checkpoint code.

Wrappers put their child under a name: ``nn.DataParallel`` and DDP under ``module.``,
``torch.compile`` under ``_orig_mod.``. :func:`strip_prefixes` removes them from one key;
:func:`match_keys` maps a whole file's keys onto a model's own keys, stripping a prefix only where
the stripped key is one the model has (a model may own a child named ``module``).
"""

from __future__ import annotations

from collections.abc import Iterable

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_prefixes(key: str) -> str:
    """``key`` without any leading wrapper prefixes (``module.``, ``_orig_mod.``), however nested."""
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                changed = True
    return key


def _common_prefixes(keys: list[str]) -> list[str]:
    """``""`` and every chain of wrapper prefixes that all ``keys`` start with, shortest first."""
    found = [""]
    while keys:
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(found[-1] + p) for k in keys)), None)
        if prefix is None:
            return found
        found.append(found[-1] + prefix)
    return found


def _stripped_once(key: str) -> Iterable[str]:
    """``key`` with one more leading wrapper prefix removed each time."""
    while True:
        prefix = next((p for p in WRAPPER_PREFIXES if key.startswith(p)), None)
        if prefix is None:
            return
        key = key[len(prefix) :]
        yield key


def match_keys(keys: Iterable[str], expected: Iterable[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Map each of ``keys`` to the model key it names, stripping wrapper prefixes only to reach one.

    The file is read as a whole first: the wrapper prefix all its keys share (none, ``module.``,
    ``module._orig_mod.``, ...) whose removal names the most model keys is removed from every key,
    so a model with a child named ``module`` keeps it. A key still not among ``expected`` loses
    leading wrapper prefixes one at a time until it names a model key; a key that never does keeps
    its name (``load_state_dict`` then reports it as unexpected). Two keys that end up naming one
    model key are a collision, for the caller to refuse.

    Returns:
        ``(mapping, collisions)``: ``mapping[key]`` is the model key; ``collisions`` lists, for each
        model key named by more than one of ``keys``, those keys.

    Example:
        >>> match_keys(["module.module.w", "module.w"], ["module.w", "w"])[0]
        {'module.module.w': 'module.w', 'module.w': 'w'}
    """
    keys, wanted = list(keys), set(expected)
    scores = {p: sum(k[len(p) :] in wanted for k in keys) for p in _common_prefixes(keys)}
    common = max(scores, key=lambda p: (scores[p], -len(p)))
    mapping = {k: k[len(common) :] for k in keys}
    for key, target in mapping.items():
        if target not in wanted:
            mapping[key] = next((c for c in _stripped_once(target) if c in wanted), target)
    named: dict[str, list[str]] = {}
    for key, target in mapping.items():
        named.setdefault(target, []).append(key)
    return mapping, {target: found for target, found in named.items() if len(found) > 1}
