"""What a live heal receives from another replica group, checked against this process's objects before any applies.

The state arrives over the network from a process this one does not control (:mod:`multigpu.session.fault_tolerance`):
a peer that runs another script or another version of it, or whatever else sent it, may hold weights of other shapes
or dtypes, an optimizer state for other parameters, a scheduler's state with a string for a count, a gradient scale
of NaN, a random state torch refuses halfway, a step count of -1. Applied as it came, some of it raises deep in torch
after the weights were already replaced, and some of it is taken silently (a momentum buffer of one element broadcasts
over any parameter). The optimizer's, the schedulers' and the gradient scale's states are held to the checks a
checkpoint's ``state.pt`` passes (:mod:`multigpu.checkpoint.validate`, its tensors on any device here); the weights,
which a checkpoint checks through its storage, and the forms only a live state has are checked here. Each refusal is
a :class:`~multigpu.errors.CheckpointError` naming the entry and the fix, raised before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from multigpu.checkpoint.file_kinds import entry_is
from multigpu.checkpoint.validate import Refusal, check_like, check_optimizer, check_scaler, walk_plain
from multigpu.errors import CheckpointError

__all__ = ["PEER", "check_like", "check_model", "check_optimizer", "check_optimizer_form", "check_precision", "list_of"]

FIX = (
    "every replica group must run the same script (model, optimizers, schedulers, loaders and precision built the "
    "same way) with the same multigpu; nothing of it was applied"
)


class _PeerRefusal(Refusal):
    """The checkpoint checks' refusal, said of the state a peer sent instead of a file."""

    def fail(self, entry: str, found: Any, expected: str) -> NoReturn:
        raise CheckpointError(
            f"the state a healthy replica group sent is refused{entry_is(entry, found, expected)}; {FIX}"
        )


PEER = _PeerRefusal(Path("the state a healthy replica group sent"), device=None)


def list_of(value: Any, where: str) -> Sequence[Any]:
    """``value`` when it is a list or tuple, else a refusal."""
    if not isinstance(value, (list, tuple)):
        PEER.fail(where, value, "a list")
    return value


def check_model(local: Mapping[str, torch.Tensor], sent: Any) -> None:
    """The sent weights: this model's names, each a tensor of its shape and dtype (loading would cast another)."""
    if not isinstance(sent, Mapping) or set(sent) != set(local):
        names = set(sent) if isinstance(sent, Mapping) else set()
        differ = sorted(map(str, names ^ set(local)))[:6]
        PEER.fail("'model'", sent if not differ else f"weights named otherwise ({differ})", "this model's names")
    for name, tensor in local.items():
        value = sent[name]
        if not isinstance(tensor, torch.Tensor):  # a module's extra state (get_extra_state): its set_extra_state checks
            continue
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape or value.dtype != tensor.dtype:
            shown = value if not isinstance(value, torch.Tensor) else f"a {value.dtype} tensor {tuple(value.shape)}"
            PEER.fail(f"'model'[{name!r}]", shown, f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
        if value.layout != torch.strided or value.is_meta or value.is_quantized or value.is_nested:  # no data to copy
            PEER.fail(f"'model'[{name!r}]", f"a {value.layout} tensor on {value.device}", "a dense tensor with data")


def check_precision(precision: Any, sent: Any) -> None:
    """The sent precision state: this precision's entries, all of them (one left out is not applied: fp16's group
    would keep its own gradient scale), and fp16's gradient scale finite and positive."""
    own = precision.state_dict()
    check_like(PEER, sent, own, "'precision'")
    if set(sent) != set(own):
        PEER.fail("'precision'", f"the entries {sorted(map(str, sent))}", f"this precision's {sorted(map(str, own))}")
    scaler = getattr(precision, "scaler", None)
    if scaler is not None and isinstance(sent, Mapping) and "scaler" in sent:
        check_scaler(PEER, sent["scaler"], scaler)


def check_optimizer_form(sent: Any, where: str) -> None:
    """The sent state of an optimizer this group has not stepped yet (a restarted group heals before its first step):
    torch's form, each parameter id once, a state only for listed ids, plain values and tensors with data. Its
    shapes and group options are held against the optimizer when the first step shows it (:func:`check_optimizer`).
    """
    if not isinstance(sent, dict) or set(sent) != {"state", "param_groups"}:
        PEER.fail(where, sent, "an optimizer's state_dict (the keys 'state' and 'param_groups')")
    groups, ids = sent["param_groups"], []
    if not isinstance(groups, list):
        PEER.fail(f"{where}['param_groups']", groups, "a list of parameter groups")
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            PEER.fail(f"{where}['param_groups'][{i}]", group, "a dict with a 'params' list")
        ids += group["params"]
        walk_plain(group, f"{where}['param_groups'][{i}]", PEER.fail, device=None)
    if not all(type(pid) is int for pid in ids) or len(set(ids)) != len(ids):
        PEER.fail(
            f"{where}['param_groups']", f"parameter ids {ids[:8]}", "ids (ints) that appear once across all groups"
        )
    state = sent["state"]
    if not isinstance(state, dict) or not set(state) <= set(ids):
        PEER.fail(f"{where}['state']", state, "a dict from the id of a listed parameter to its state")
    walk_plain(state, f"{where}['state']", PEER.fail, device=None)
