"""``EpochLoader.before_iteration``: a position loaded there is the iteration's own, from its first batch (issue 31).

A fault-tolerant replica group whose loop iterates a session loader itself (not ``session.batches``)
joins the other groups there, and a restarted one receives their position in that call: its first
batch must already come from that position (plain DataLoader over the same sampler: the oracle).
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from multigpu.runtime.data import ShardSpec, build_epoch_loader


def _loader(n: int = 20, batch: int = 4):
    return build_epoch_loader(TensorDataset(torch.arange(float(n))), global_batch=batch, shard=ShardSpec())


def test_a_position_loaded_before_the_iteration_starts_gives_its_first_batch() -> None:
    sender, healed = _loader(), _loader()
    for _ in range(2):  # the others are in their third epoch, at its fourth batch
        list(sender)
    taken = iter(sender)
    for _ in range(3):
        next(taken)
    position = sender.state_dict()
    calls = []

    def join() -> None:  # what a restarted group's join does: load the position it received, once
        calls.append(1)
        if len(calls) == 1:
            healed.load_state_dict(position)

    healed.before_iteration = join
    got = [b[0].tolist() for b in healed]
    assert got == [b[0].tolist() for b in taken]  # from the others' next batch on, not from the epoch's start
    assert healed.state_dict() == sender.state_dict()
    assert [b[0].tolist() for b in healed] == [b[0].tolist() for b in sender]  # the epoch after, alike
    assert len(calls) == 2  # once as each iteration starts


def test_without_a_hook_the_loader_iterates_as_before() -> None:
    loader, oracle = _loader(), _loader()
    assert loader.before_iteration is None
    assert [b[0].tolist() for b in loader] == [b[0].tolist() for b in oracle]
