"""DataParallel's state-dict hooks: save the bare model's keys, load bare or wrapped ones.

Saving drops the ``module.`` segment the wrapper adds, so ``model.state_dict()`` loads into the
unwrapped model. Loading maps each key onto the wrapped module's own keys, stripping the
prefixes other wrappers add (``module.``, ``_orig_mod.``) only where that reaches one of its keys,
so a model with a child named ``module`` loads its own checkpoint.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from multigpu._keys import collision_message, map_keys
from multigpu.errors import CheckpointError


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
    mapping, collisions = map_keys([k[len(prefix) :] for k in own], inner.state_dict().keys())
    if collisions:
        raise CheckpointError(collision_message("the state dict", collisions))
    values = {key: state_dict.pop(key) for key in own}  # all out first: a new key may equal an old one
    for key, value in values.items():
        local = key[len(prefix) :]
        state_dict[prefix + "module." + mapping.get(local, local)] = value
