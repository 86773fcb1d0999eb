"""A live heal's state comes from another process: LiveState refuses one unlike its own before applying any of it.

The oracle is the receiving group's own state, unchanged: weights, step count, loader position, random stream,
optimizer and scheduler. Each case takes a state a real sender made (a LiveState over the same script's objects,
marked as a step's quorum marks it) and damages one entry as a peer running another script, or something else on
the network, could send it.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from multigpu.errors import CheckpointError
from multigpu.runtime.committed_steps import committed_steps, set_committed_steps
from multigpu.runtime.data import ShardSpec, build_epoch_loader
from multigpu.session.fault_tolerance import LiveState
from multigpu.strategies.precision import build_precision


def _group(seed: int) -> tuple[LiveState, torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    loader = build_epoch_loader(torch.utils.data.TensorDataset(torch.arange(12.0)), global_batch=2, shard=ShardSpec())
    live = LiveState()
    live.model, live.precision = model, build_precision("fp16", "cpu")
    live.add_loader(loader)
    live.attach_optimizer(optimizer)
    return live, model, optimizer, (scheduler, loader)


def _sent() -> dict[str, Any]:
    live, model, optimizer, (scheduler, loader) = _group(1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    set_committed_steps(7)
    next(iter(loader))
    live.mark(1, 1)
    return copy.deepcopy(live.state_dict())


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def damage(state: dict[str, Any]) -> None:
        *inner, last = path
        target: Any = state
        for key in inner:
            target = target[key]
        if value is _DROP:
            del target[last]
        else:
            target[last] = value(target[last]) if callable(value) else value

    return damage


_DROP = object()
DAMAGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "no model": _set(("model",), _DROP),
    "a step count but no positions": _set(("loaders",), _DROP),
    "a negative step count": _set(("global_step",), -1),
    "a step count as text": _set(("global_step",), "7"),
    "a weight of another shape": _set(("model", "0.weight"), lambda w: w[:, :2]),
    "a weight of another dtype": _set(("model", "0.weight"), lambda w: w.double()),
    "a weight too many": _set(("model", "extra"), torch.zeros(1)),
    "a weight missing": _set(("model", "0.bias"), _DROP),
    "a weight that is a list": _set(("model", "0.bias"), [0.0] * 4),
    "a weight without data": _set(("model", "1.bias"), torch.empty(4, device="meta")),  # after others: half applied
    "a sparse weight": _set(("model", "1.bias"), torch.zeros(4).to_sparse()),
    "a torch random state of another size": _set(("rng", "torch"), lambda t: t[:10]),
    "a python random state of garbage": _set(("rng", "python"), (3, (1, 2), None)),
    "a numpy random state of garbage": _set(("rng", "numpy"), ("MT19937", [1, 2])),
    "a loader position beyond the epoch": _set(("loaders", 0, "batch"), 99),
    "a loader position of another batch size": _set(("loaders", 0, "data", "global_batch"), 3),
    "a one-element momentum buffer": _set(("optimizers", 0, "state", 0, "momentum_buffer"), torch.zeros(1, 1)),
    "a momentum buffer without data": _set(
        ("optimizers", 0, "state", 0, "momentum_buffer"), torch.empty(4, 3, device="meta")
    ),
    "another count of parameter groups": _set(("optimizers", 0, "param_groups"), lambda g: g * 2),
    "a parameter state for no parameter": _set(("optimizers", 0, "state", 99), {"momentum_buffer": torch.zeros(1)}),
    "a learning rate as text": _set(("optimizers", 0, "param_groups", 0, "lr"), "0.5"),
    "a scheduler without its kind": _set(("schedulers", 0, 0), {"state": {}}),
    "a scheduler count as text": _set(("schedulers", 0, 0, "state", "last_epoch"), "x"),
    "a scheduler with base rates of other groups": _set(("schedulers", 0, 0, "state", "base_lrs"), [1.0, 2.0]),
    "a gradient scale of NaN": _set(("precision", "scaler", "scale"), math.nan),
    "a negative gradient scale": _set(("precision", "scaler", "scale"), -1.0),
    "an entry it never sends": _set(("surprise",), 1),
    # a sender with a model sends its weights: an empty mapping left this group on its own weights, the rest applied
    "no weights at all": _set(("model",), {}),
    "no precision state": _set(("precision",), {}),  # fp16: the group kept its own gradient scale
    "no gradient scale": _set(("precision", "scaler"), _DROP),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_state_from_a_peer_is_refused_before_any_of_it_applies(damage: str) -> None:
    state = _sent()
    DAMAGES[damage](state)
    live, model, optimizer, (scheduler, loader) = _group(2)
    set_committed_steps(0)
    before = (copy.deepcopy(model.state_dict()), loader.state_dict(), torch.get_rng_state(), random.getstate())
    scheduled = (scheduler.state_dict(), copy.deepcopy(optimizer.state_dict()), live.precision.state_dict())
    with pytest.raises(
        CheckpointError, match=r"the state a healthy replica group sent is refused: .* is .*; expected .*same script"
    ):
        live.load_state_dict(state)
    after = (model.state_dict(), loader.state_dict(), torch.get_rng_state(), random.getstate())
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and before[1] == after[1]
    assert torch.equal(before[2], after[2]) and before[3] == after[3] and committed_steps() == 0
    assert scheduled == (scheduler.state_dict(), optimizer.state_dict(), live.precision.state_dict())


def test_the_state_a_sender_makes_applies_whole() -> None:
    state = _sent()
    live, model, optimizer, (scheduler, loader) = _group(2)
    live.load_state_dict(copy.deepcopy(state))
    assert all(torch.equal(v, state["model"][k]) for k, v in model.state_dict().items())
    assert committed_steps() == 7 and loader.state_dict() == state["loaders"][0]
    assert scheduler.state_dict() == state["schedulers"][0][0]["state"]
    assert torch.equal(
        optimizer.state_dict()["state"][0]["momentum_buffer"], state["optimizers"][0]["state"][0]["momentum_buffer"]
    )


class _WithExtraState(torch.nn.Linear):
    def get_extra_state(self) -> dict[str, int]:
        return {"calls": self.calls}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]


def test_a_modules_extra_state_travels_with_the_weights() -> None:
    sender, receiver = LiveState(), LiveState()
    sender.model, receiver.model = _WithExtraState(2, 2), _WithExtraState(2, 2)
    sender.model.calls, receiver.model.calls = 7, 0
    receiver.load_state_dict(copy.deepcopy(sender.state_dict()))
    assert receiver.model.calls == 7 and torch.equal(receiver.model.weight, sender.model.weight)


UNSEEN_OPTIMIZER = {
    "not a state dict": "garbage",
    "groups that are text": {"state": {}, "param_groups": "x"},
    "a parameter id twice": {"state": {}, "param_groups": [{"params": [0, 0], "lr": 0.5}]},
    "a state for no parameter": {"state": {5: {}}, "param_groups": [{"params": [0], "lr": 0.5}]},
    "a buffer without data": {
        "state": {0: {"momentum_buffer": torch.empty(4, 3, device="meta")}},
        "param_groups": [{"params": [0, 1], "lr": 0.5}],
    },
}


@pytest.mark.parametrize("damage", UNSEEN_OPTIMIZER)
def test_an_optimizer_state_for_an_optimizer_not_stepped_yet_is_refused_before_any_of_it_applies(damage: str) -> None:
    # a restarted group heals before its first step: its optimizers are not known yet, and their states wait for
    # it; they were not looked at until that step, after the weights, step count and positions had been applied
    state = _sent()
    state["optimizers"][0] = UNSEEN_OPTIMIZER[damage]
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    live = LiveState()
    live.model = model
    set_committed_steps(0)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=r"the state a healthy replica group sent is refused: .*'optimizers'"):
        live.load_state_dict(state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and committed_steps() == 0
