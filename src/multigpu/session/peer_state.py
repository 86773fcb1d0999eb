"""What a live heal receives from another replica group, checked against this process's objects before any applies.

The state arrives over the network from a process this one does not control (:mod:`multigpu.session.fault_tolerance`):
a peer that runs another script or another version of it, or whatever else sent it, may hold weights of other shapes
or dtypes, an optimizer state for other parameters, a scheduler's state with a string for a count, a gradient scale
of NaN, a random state torch refuses halfway, a step count of -1. Applied as it came, some of it raises deep in torch
after the weights were already replaced, and some of it is taken silently (a momentum buffer of one element broadcasts
over any parameter). :func:`mismatch` compares a received value with the one this process holds in the same place;
the checks of :class:`~multigpu.session.fault_tolerance.LiveState` and of the schedulers' states build on it and
raise :class:`~multigpu.errors.CheckpointError` naming the entry and the fix before anything changes.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from multigpu.errors import CheckpointError

FIX = (
    "every replica group must run the same script (model, optimizers, schedulers, loaders and precision built the "
    "same way) with the same multigpu; nothing of it was applied"
)


def refused(where: str, why: str) -> CheckpointError:
    """The error for the received state's entry ``where`` (``why``: how it differs), with the fix."""
    return CheckpointError(f"the state a healthy replica group sent has {where} {why}; {FIX}")


def mismatch(local: Any, sent: Any, where: str = "") -> str | None:
    """How ``sent`` differs in kind from ``local`` (the value this process holds there), or None when it fits.

    Mappings need the same keys, sequences the same length (each item compared), tensors the same shape and dtype,
    numbers a finite number (an int where ``local`` is an int), text text; a ``local`` None takes anything plain.
    """
    if isinstance(local, torch.Tensor):
        if not isinstance(sent, torch.Tensor):
            return f"{where}: {_shown(sent)}, not a tensor"
        if sent.shape != local.shape or sent.dtype != local.dtype:
            return (
                f"{where}: a {sent.dtype} tensor of shape {tuple(sent.shape)}, here {local.dtype} {tuple(local.shape)}"
            )
        return None
    if isinstance(local, Mapping):
        if not isinstance(sent, Mapping) or set(sent) != set(local):
            return f"{where}: {_shown(sent)}, here a mapping of {sorted(map(str, local))}"
        return next((m for k in local if (m := mismatch(local[k], sent[k], f"{where}[{k!r}]"))), None)
    if isinstance(local, (list, tuple)):
        if not isinstance(sent, (list, tuple)) or len(sent) != len(local):
            return f"{where}: {_shown(sent)}, here {len(local)} items"
        return next((m for i, v in enumerate(local) if (m := mismatch(v, sent[i], f"{where}[{i}]"))), None)
    if isinstance(local, bool) or local is None:
        ok = isinstance(sent, bool) if isinstance(local, bool) else sent is None or _plain(sent)
        return None if ok else f"{where}: {_shown(sent)}, here {local!r}"
    if isinstance(local, numbers.Real):
        whole = isinstance(local, numbers.Integral)
        fits = isinstance(sent, numbers.Integral if whole else numbers.Real) and not isinstance(sent, bool)
        if fits and (whole or math.isfinite(sent) or not math.isfinite(local)):
            return None
        return f"{where}: {_shown(sent)}, here {'an int' if whole else 'a finite number'}"
    if isinstance(local, str):
        return None if isinstance(sent, str) else f"{where}: {_shown(sent)}, here text"
    return None  # an object of the script's own (a callable's state): its own load_state_dict checks it


def check_like(local: Any, sent: Any, where: str) -> None:
    """Raise :func:`refused` when :func:`mismatch` finds ``sent`` unlike ``local``."""
    found = mismatch(local, sent, where)
    if found is not None:
        raise refused(found.split(":", 1)[0], "unlike this group's:" + found.split(":", 1)[1])


def list_of(value: Any, where: str, length: int | None = None) -> Sequence[Any]:
    """``value`` when it is a list (of ``length`` items, when given), else :func:`refused`."""
    if not isinstance(value, (list, tuple)) or (length is not None and len(value) != length):
        wanted = "a list" if length is None else f"a list of {length} (one per one built here)"
        raise refused(where, f"{_shown(value)}, not {wanted}")
    return value


def _plain(value: Any) -> bool:
    if isinstance(value, (str, numbers.Real, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, Mapping) and all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())


def _shown(value: Any) -> str:
    return reprlib.repr(value) if not isinstance(value, torch.Tensor) else f"a tensor {tuple(value.shape)}"


def check_optimizer(optimizer: torch.optim.Optimizer, sent: Any, where: str) -> None:
    """Refuse an optimizer state for other parameter groups, or whose per-parameter tensors fit other parameters.

    A restarted group's optimizer holds no per-parameter state yet, so each received tensor is held against its
    parameter: of the parameter's shape, or of fewer dimensions (a step count, a factored second moment).
    """
    local = optimizer.state_dict()
    if not isinstance(sent, Mapping) or set(sent) != {"state", "param_groups"}:
        raise refused(where, f"{_shown(sent)}, not an optimizer's state_dict (its 'state' and 'param_groups')")
    groups = list_of(sent["param_groups"], f"{where}['param_groups']", len(local["param_groups"]))
    params: dict[Any, torch.Tensor] = {}
    for number, (here, group, mine) in enumerate(zip(local["param_groups"], groups, optimizer.param_groups)):
        at = f"{where}['param_groups'][{number}]"
        if not isinstance(group, Mapping):
            raise refused(at, f"{_shown(group)}, not a parameter group")
        ids = list_of(group.get("params"), f"{at}['params']", len(here["params"]))
        params.update(zip(ids, mine["params"]))
        for key in here:
            if key != "params" and key in group:
                check_like(here[key], group[key], f"{at}[{key!r}]")
    state = sent["state"]
    if not isinstance(state, Mapping) or not set(state) <= set(params):
        raise refused(f"{where}['state']", f"{_shown(state)}, not a state of the parameters {sorted(params)}")
    for key, values in state.items():
        at = f"{where}['state'][{key!r}]"
        if not isinstance(values, Mapping):
            raise refused(at, f"{_shown(values)}, not a mapping")
        param = params[key]
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and (
                value.dim() > param.dim() or (value.dim() == param.dim() and value.shape != param.shape)
            ):
                raise refused(
                    f"{at}[{name!r}]", f"of shape {tuple(value.shape)} for a parameter of {tuple(param.shape)}"
                )
            if not isinstance(value, torch.Tensor) and not _plain(value) and value is not None:
                raise refused(f"{at}[{name!r}]", f"{_shown(value)}, not a tensor or number")
