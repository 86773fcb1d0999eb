"""Activation checkpointing: chosen modules keep only their inputs in forward and recompute the rest in backward.

``Session(activation_checkpointing=[Block])`` wraps every ``Block`` of the model with torch's own
``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``, which restores the random state
for the recomputation, so dropout draws the same masks twice and the gradients are those of a run
without it). The Session applies it in the order FSDP and ``torch.compile`` need: after sync
BatchNorm's module swap, before the strategy wraps the model (DDP, DataParallel, ``fully_shard``),
and before ``compile``.

Wrap the repeated block, not its children: a block's input is one tensor, while its children's
outputs (attention, MLP, norms) are most of what a transformer stores; checkpointing each child
keeps every child's input, which is most of the memory anyway. So a choice that matches no module
is refused, and so is one that matches modules nested inside each other (the inner one would be
recomputed twice in backward).

Example:
    >>> net = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    >>> net = apply_activation_checkpointing(net, [nn.Sequential])  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from functools import partial

from torch import nn

from multigpu.errors import ConfigError

CheckpointChoice = Sequence[type[nn.Module]] | Callable[[nn.Module], bool]


def normalize_choice(choice: object) -> tuple[type[nn.Module], ...] | Callable[[nn.Module], bool] | None:
    """``choice`` as a tuple of module classes, a predicate, or None; refused when it is neither.

    Raises:
        ConfigError: not module classes (a class alone is taken as a list of one), a predicate or None.
    """
    if choice is None:
        return None
    if isinstance(choice, type) and issubclass(choice, nn.Module):
        return (choice,)
    if isinstance(choice, (list, tuple, set, frozenset)):
        classes = tuple(choice)
        if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            return classes
    elif isinstance(choice, nn.Module):
        name = type(choice).__name__
        raise ConfigError(
            f"activation_checkpointing=<a {name} module> must be the module classes to recompute in backward, "
            f"not a module: pass its class, activation_checkpointing=[{name}]"
        )
    elif callable(choice) and not isinstance(choice, type):
        return choice  # type: ignore[return-value]
    raise ConfigError(
        f"activation_checkpointing={choice!r} must be the module classes to recompute in backward (the "
        "model's repeated block, e.g. activation_checkpointing=[GPT2Block]), a predicate "
        "module -> bool, or None"
    )


def apply_activation_checkpointing(
    model: nn.Module, choice: tuple[type[nn.Module], ...] | Callable[[nn.Module], bool]
) -> nn.Module:
    """``model`` with each chosen submodule wrapped in torch's non-reentrant ``checkpoint_wrapper`` (in place).

    Args:
        model: the bare model, before the strategy wraps it.
        choice: module classes, or a predicate on modules (see :func:`normalize_choice`).

    Returns:
        ``model``: the chosen submodules replaced by ``CheckpointWrapper``s around them (their
        ``state_dict`` keys gain ``_checkpoint_wrapped_module.``, which torch's wrapper strips again
        when the state dict is saved or loaded).

    Raises:
        ConfigError: the choice matches no submodule, matches the model itself, or matches
            modules nested inside each other (naming both).
    """
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_ac

    matches = _matcher(choice)
    if matches(model):
        raise ConfigError(
            f"activation_checkpointing={_describe(choice)} matches the model itself "
            f"({type(model).__name__}); name its repeated block instead, e.g. the class of each layer"
        )
    chosen = [(name, m) for name, m in model.named_modules() if name and matches(m)]
    if not chosen:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            f"activation_checkpointing={_describe(choice)} matches no module of the model; its module classes "
            f"are {classes}: name the repeated block (e.g. a transformer layer)"
        )
    _refuse_nested(chosen, choice)
    _stop_caching_keys(model)
    wrapper = partial(torch_ac.checkpoint_wrapper, checkpoint_impl=torch_ac.CheckpointImpl.NO_REENTRANT)
    torch_ac.apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=matches)
    return model


def _stop_caching_keys(model: nn.Module) -> None:
    """Turn off a Hugging Face model's key/value cache (``config.use_cache``), with a warning.

    The cache grows at every forward of an attention layer; the recomputation in backward is a
    second forward, which appends the keys again and fails on a mask of half their length (as
    ``transformers``' own ``gradient_checkpointing_enable`` does, training does without it).
    """
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        warnings.warn(
            f"activation_checkpointing: set {type(model).__name__}.config.use_cache = False (it was True): a "
            "recomputed block would append its keys to the cache a second time; set it yourself to silence this",
            stacklevel=4,
        )
        config.use_cache = False  # type: ignore[union-attr]


def _matcher(choice: tuple[type[nn.Module], ...] | Callable[[nn.Module], bool]) -> Callable[[nn.Module], bool]:
    if isinstance(choice, tuple):
        classes = choice
        return lambda module: isinstance(module, classes)
    return lambda module: bool(choice(module))


def _refuse_nested(chosen: list[tuple[str, nn.Module]], choice: object) -> None:
    names = [name for name, _ in chosen]
    for outer in names:
        inner = next((n for n in names if n.startswith(outer + ".")), None)
        if inner is not None:
            raise ConfigError(
                f"activation_checkpointing={_describe(choice)} matches {outer!r} and {inner!r} inside it: the inner "
                "module would be recomputed twice in backward; name only the outer block's class (or a "
                "predicate that picks one level)"
            )


def _describe(choice: object) -> str:
    if isinstance(choice, tuple):
        return "[" + ", ".join(c.__name__ for c in choice) + "]"
    return getattr(choice, "__name__", repr(choice))
