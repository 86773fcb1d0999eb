"""A live heal's loader position for a loader the restarted group builds later waits for that loader.

A restarted replica group heals at its first quorum; a script that builds a second loader after that (an
evaluation loader, the next phase's data) received its position with the rest, and the heal applied only
as many positions as this group had loaders then: the later loader started at its beginning while the
others' stood inside their epochs (the groups' batches apart, silently). The oracle is the sender's loader.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from multigpu.errors import CheckpointError
from multigpu.runtime.committed_steps import committed_steps, set_committed_steps
from multigpu.runtime.data import EpochLoader, ShardSpec, build_epoch_loader
from multigpu.session.fault_tolerance import LiveState


def _loader(n: int = 12) -> EpochLoader[Any]:
    return build_epoch_loader(torch.utils.data.TensorDataset(torch.arange(float(n))), global_batch=2, shard=ShardSpec())


def _sender(batches: tuple[int, int]) -> tuple[dict[str, Any], list[EpochLoader[Any]]]:
    live, loaders = LiveState(), [_loader(), _loader(20)]
    for loader, taken in zip(loaders, batches):
        live.add_loader(loader)
        it = iter(loader)
        for _ in range(taken):
            next(it)
    live.mark(0, 1)
    return copy.deepcopy(live.state_dict()), loaders


@pytest.fixture(autouse=True)
def _steps_kept() -> Any:
    before = committed_steps()
    yield
    set_committed_steps(before)


@pytest.mark.parametrize("inside_step", [False, True])
def test_a_position_for_a_loader_built_after_the_heal_is_applied_when_it_is_built(inside_step: bool) -> None:
    state, _ = _sender((3, 5))
    live, first = LiveState(), _loader()
    live.add_loader(first)
    live.load_state_dict(state, inside_step=inside_step)
    key = "loaders_after" if inside_step else "loaders"
    assert first.state_dict() == state[key][0]
    later = _loader(20)
    live.add_loader(later)  # the script builds its second loader now
    assert later.state_dict() == state[key][1]
    assert [b[0].tolist() for b in later] == [b[0].tolist() for b in _at(_loader(20), state[key][1])]
    again = _loader(20)
    live.add_loader(again)  # a third loader has no position waiting: it starts at its beginning
    assert again.state_dict()["batch"] == 0 and again.state_dict()["epoch"] == 0


def test_a_later_heal_replaces_a_position_still_waiting() -> None:
    live = LiveState()
    live.add_loader(_loader())
    live.load_state_dict(_sender((3, 5))[0])
    newer, _ = _sender((2, 1))
    live.load_state_dict(newer)
    later = _loader(20)
    live.add_loader(later)
    assert later.state_dict() == newer["loaders"][1]


def test_a_waiting_position_the_later_loader_cannot_take_is_refused_naming_it() -> None:
    state, _ = _sender((3, 5))
    live = LiveState()
    live.add_loader(_loader())
    live.load_state_dict(state)
    other = _loader(7)  # another dataset's loader where the sender had its second
    with pytest.raises(CheckpointError, match=r"'loaders'\[1\]"):
        live.add_loader(other)
    assert other.state_dict()["batch"] == 0  # nothing applied


def test_a_waiting_position_of_the_wrong_form_is_refused_at_the_heal() -> None:
    state, _ = _sender((3, 5))
    state["loaders"][1] = {"epoch": "one", "batch": 2}
    live, first = LiveState(), _loader()
    live.add_loader(first)
    before = first.state_dict()
    with pytest.raises(CheckpointError, match=r"'loaders'\[1\]"):
        live.load_state_dict(state)
    assert first.state_dict() == before  # nothing applied


def _at(loader: EpochLoader[Any], position: dict[str, Any]) -> EpochLoader[Any]:
    loader.load_state_dict(position)
    return loader
