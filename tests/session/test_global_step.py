"""``session.global_step``: the optimizer steps committed in this run, saved and put back by the Checkpointer.

And what a restarted replica group receives (:mod:`multigpu.session.fault_tolerance`): the loader's
position rewound to the batch the others train now, also across an epoch's end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multigpu
from multigpu.errors import ConfigError
from multigpu.session import Session
from multigpu.session.fault_tolerance import LiveState


def train(session: Session, model: nn.Module, optimizer: torch.optim.Optimizer, loader, steps: int) -> list[bool]:
    results = []
    for x, y in session.batches(loader):
        with session.micro_step(model):
            session.backward(F.mse_loss(model(x), y))
        results.append(session.step(optimizer))
        if len(results) == steps:
            break
    return results


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator)
    )


def test_global_step_counts_committed_steps_and_resume_puts_it_back(tmp_path: Path) -> None:
    with Session(strategy="single", accumulate=2) as session:
        model = session.setup_model(nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = session.build_loader(dataset(), batch_size=4)
        results = train(session, model, optimizer, loader, 6)
        assert results == [False, True] * 3
        assert session.global_step == 3
        multigpu.Checkpointer(folder=tmp_path).save(step=7, model=model, optimizer=optimizer)
    with Session(strategy="single") as session:
        assert session.global_step == 0  # a new run counts from 0
        model = session.setup_model(nn.Linear(4, 1))
        multigpu.Checkpointer(folder=tmp_path).resume(model=model)
        assert session.global_step == 3  # the committed steps saved, not the step number the folder is named by


def test_global_step_refuses_a_negative_value() -> None:
    with Session(strategy="single") as session, pytest.raises(ConfigError, match=r"global_step=-1 must be an int >= 0"):
        session.global_step = -1


def test_a_restarted_group_gets_the_position_of_the_batch_the_others_train_now() -> None:
    with Session(strategy="single") as session:
        model = session.setup_model(nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = session.build_loader(dataset(), batch_size=8)  # 4 batches an epoch
        live = LiveState()
        live.add_loader(loader)
        live.model = model  # a sender sends its weights (a state without them is refused where a model is set up)
        batches = session.batches(loader)
        for _ in range(4):  # the last batch of epoch 0 is in flight: the loader already reads epoch 1
            next(batches)
        live.mark(window_batches=1, accumulate=1)
        assert live.state_dict()["loaders"][0] | {"data": None} == {"epoch": 0, "batch": 3, "data": None}
        # a group healed inside this step goes on after it: epoch 0's end (the next iteration is epoch 1)
        assert live.state_dict()["loaders_after"][0] | {"data": None} == {"epoch": 0, "batch": 4, "data": None}
        fresh = session.build_loader(dataset(), batch_size=8)
        other = LiveState()
        other.add_loader(fresh)
        other.model, other.optimizers = model, [optimizer]
        other.load_state_dict(live.state_dict())
        taken = [x for x, _ in fresh]
        assert len(taken) == 1  # the restarted group trains epoch 0's last batch with the others, then goes on
        batches.close()
