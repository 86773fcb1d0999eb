"""The learning-rate schedulers of an optimizer, found without the script's help, for a live heal.

A replica group healed live (:mod:`multigpu.session.fault_tolerance`) receives the sender's optimizer
state, which carries the sender's learning rates; but its own ``torch.optim.lr_scheduler`` objects
keep their own counts (0 in a restarted group), so their next ``step()`` would set other rates than
the sender's, and the groups' weights would drift apart. The Session never sees a scheduler (the
script steps it), and torch keeps no reference from an optimizer to its schedulers (the
``optimizer.step`` wrapper a scheduler installs holds the optimizer only): they are found here as the
objects that refer to the optimizer (``gc.get_referrers``), once per send and once per heal.

Which are sent: each scheduler of the optimizer that is not inside another's chain (a
``SequentialLR`` or ``ChainedScheduler`` sends its members' states in its own), in the order of their
class names, so that the n-th ``StepLR`` of one group's optimizer meets the n-th of another's. Two
unchained schedulers of one class on one optimizer cannot be told apart across processes: they are
matched in an order that may differ, with a warning.
"""

from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from multigpu.session.peer_state import PEER, check_like, list_of

_SCHEDULERS = (LRScheduler, ReduceLROnPlateau)  # ReduceLROnPlateau was not an LRScheduler before torch 2.2


def find_schedulers(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The schedulers that step ``optimizer`` and are not a member of another's chain, ordered by class name.

    A scheduler the script no longer holds is collected first: held in a reference cycle, it would be found and
    sent too (its state matched to a live scheduler of its class on the healed side). Since Python 3.11 an
    instance's attributes live inline until its ``__dict__`` is first read (a
    scheduler's ``state_dict`` reads it): the object that refers to the optimizer is then the scheduler
    itself, or else its ``__dict__``, whose owner one more search finds.
    """
    gc.collect()  # a scheduler the script dropped may live on in a reference cycle until the collector runs
    found: list[Any] = []
    dicts: list[dict[str, Any]] = []
    for referrer in gc.get_referrers(optimizer):
        if isinstance(referrer, _SCHEDULERS) and referrer.optimizer is optimizer:
            found.append(referrer)
        elif type(referrer) is dict and referrer.get("optimizer") is optimizer:
            dicts.append(referrer)
    if dicts:
        for owner in gc.get_referrers(*dicts):
            if isinstance(owner, _SCHEDULERS) and any(owner.__dict__ is d for d in dicts):
                found.append(owner)
    unique = list({id(s): s for s in found}.values())
    members = {id(m) for s in unique for m in _members(s)}
    return sorted((s for s in unique if id(s) not in members), key=_kind)


def scheduler_states(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """What a healthy group sends of ``optimizer``'s schedulers: each one's class name and a copy of its state."""
    return [{"kind": _kind(s), "state": copy.deepcopy(s.state_dict())} for s in find_schedulers(optimizer)]


def check_scheduler_states(optimizer: torch.optim.Optimizer | None, states: Any, index: int) -> None:
    """Refuse (a CheckpointError naming the entry) sent states that :func:`load_scheduler_states` cannot apply whole.

    Each entry is a class name and a state; each state is held against the state of the scheduler it goes to here
    as a checkpoint's is (:func:`multigpu.checkpoint.validate.check_like`: only its entries, numbers where it has
    numbers, lists of its lengths, so one base rate per parameter group).
    ``optimizer``: None when the Session has not seen it yet (only the entries' form is checked).
    """
    where = f"'schedulers'[{index}]"
    entries = list_of(states, where)
    for number, sent in enumerate(entries):
        if not (
            isinstance(sent, Mapping) and isinstance(sent.get("kind"), str) and isinstance(sent.get("state"), dict)
        ):
            PEER.fail(f"{where}[{number}]", sent, "a scheduler's 'kind' (text) and 'state' (a dict)")
    if optimizer is None:
        return
    unmatched = find_schedulers(optimizer)
    for number, sent in enumerate(entries):
        match = next((s for s in unmatched if _kind(s) == sent["kind"]), None)
        if match is not None:
            unmatched.remove(match)
            check_like(PEER, sent["state"], match.state_dict(), f"{where}[{number}]['state']")


def load_scheduler_states(optimizer: torch.optim.Optimizer, states: list[dict[str, Any]], index: int) -> None:
    """Give ``optimizer``'s schedulers the states a healthy group sent (:func:`scheduler_states`).

    The n-th received scheduler of a class goes to the n-th here. One without a counterpart, on either
    side (the script built its schedulers at another point than the sender's did), is left out with a
    warning: that group's learning rates may then differ from the others'. ``index``: the optimizer's
    (in the order the Session first saw them), which the warnings name.
    """
    check_scheduler_states(optimizer, states, index)
    here = find_schedulers(optimizer)
    kinds = [_kind(s) for s in here]
    for kind in set(kinds):
        if kinds.count(kind) > 1:
            warnings.warn(
                f"optimizer {index} has {kinds.count(kind)} unchained {kind} schedulers: a replica group healed live "
                "gives them the sender's states in an order that may differ; chain them (SequentialLR, "
                "ChainedScheduler) or give each its own optimizer",
                RuntimeWarning,
                stacklevel=2,
            )
    unmatched = list(here)
    for sent in states:
        match = next((s for s in unmatched if _kind(s) == sent["kind"]), None)
        if match is None:
            warnings.warn(
                f"the healthy replica group's {sent['kind']} on optimizer {index} has no counterpart here: this "
                "group's learning rates may differ from the others'; build the schedulers before the loop's first "
                "session.step, as every group does",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        unmatched.remove(match)
        match.load_state_dict(copy.deepcopy(sent["state"]))
    for scheduler in unmatched:
        warnings.warn(
            f"this replica group's {_kind(scheduler)} on optimizer {index} received no state from the healthy group "
            "(it had none of that class): it keeps its own count, and its learning rates may differ from the "
            "others'; build the schedulers before the loop's first session.step, as every group does",
            RuntimeWarning,
            stacklevel=2,
        )


def _members(scheduler: Any) -> list[Any]:
    """The schedulers chained inside ``scheduler`` (SequentialLR, ChainedScheduler), at any depth."""
    inner = list(getattr(scheduler, "_schedulers", None) or [])
    return inner + [m for s in inner for m in _members(s)]


def _kind(scheduler: Any) -> str:
    kind = type(scheduler)
    return f"{kind.__module__}.{kind.__qualname__}"
