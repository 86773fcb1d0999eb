"""A loader position loaded while an iteration is in flight moves that iteration (issue 31).

A replica group that heals inside ``session.step`` loads the others' position while its loop iterates
the loader: the iteration in flight goes on from the loaded position, as a fresh loader loaded there
does, and the epochs after it follow as they would have.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from multigpu.runtime.data import EpochLoader, ShardSpec, build_epoch_loader

_EXAMPLES = int(os.environ.get("MULTIGPU_FUZZ_EXAMPLES", "30"))


def _build(n: int, world: int, rank: int, per_rank: int, drop_last: bool) -> EpochLoader[Any]:
    return build_epoch_loader(
        TensorDataset(torch.arange(n)),
        global_batch=world * per_rank,
        shard=ShardSpec(world_size=world, rank=rank),
        drop_last=drop_last,
        seed=3,
    )


def _samples(batches: Any) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


@settings(max_examples=_EXAMPLES, derandomize=True, deadline=None)
@given(
    world=st.integers(1, 3),
    per_rank=st.integers(1, 3),
    n=st.integers(9, 40),
    drop_last=st.booleans(),
    taken=st.integers(0, 30),
    target=st.integers(0, 30),
    at_end=st.booleans(),
    then=st.integers(0, 4),
)
def test_a_position_loaded_mid_iteration_moves_the_iteration_in_flight(
    world: int, per_rank: int, n: int, drop_last: bool, taken: int, target: int, at_end: bool, then: int
) -> None:
    rank = world - 1
    build = lambda: _build(n, world, rank, per_rank, drop_last)  # noqa: E731
    length = len(build())
    # where the loop stands: some epochs done, `taken` batches of this one received
    moving = build()
    for _ in range(taken // length):
        list(moving)
    in_flight = iter(moving)
    for _ in range(taken % length):
        next(in_flight)
    # the position loaded: any batch of the first epochs, or an epoch's end (the sender's last batch closed a window)
    epoch, batch = divmod(target, length)
    state = {**build().state_dict(), "epoch": epoch, "batch": length if at_end else batch}
    moving.load_state_dict(state)
    fresh = build()
    fresh.load_state_dict(state)
    assert moving.state_dict() == fresh.state_dict()
    expected = iter(fresh)
    for got, want in zip(in_flight, expected):  # the same iterator object goes on from the loaded position
        assert got[0].tolist() == want[0].tolist()
        assert moving.state_dict() == fresh.state_dict()
    assert next(expected, None) is None  # and ends with the loaded epoch, no sooner
    assert moving.state_dict() == fresh.state_dict() and moving.epoch == fresh.epoch
    for _ in range(then):  # the epochs after: whole, in the order a fresh loader takes them
        assert _samples(moving) == _samples(fresh)


def test_a_position_loaded_between_iterations_starts_the_next_one_there_and_an_abandoned_iteration_keeps_out() -> None:
    loader, reference = _build(20, 1, 0, 4, True), _build(20, 1, 0, 4, True)
    epochs = [_samples(reference) for _ in range(3)]
    abandoned = iter(loader)
    next(abandoned)  # a loop that broke out: a resumed checkpoint's position goes to the next iteration
    loader.load_state_dict({**loader.state_dict(), "epoch": 1, "batch": 2})
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batch"] == 2
    assert _samples(loader) == epochs[1][2:]
    assert _samples(loader) == epochs[2]
    assert loader.state_dict()["epoch"] == 3


def test_skipping_past_an_epochs_end_reports_the_epoch_after() -> None:
    loader = _build(20, 1, 0, 4, True)
    loader.skip_first_batches(5)  # the whole epoch 0
    assert (loader.state_dict()["epoch"], loader.state_dict()["batch"]) == (1, 0)
    assert _samples(loader) == []
    assert (loader.state_dict()["epoch"], loader.state_dict()["batch"]) == (1, 0)
