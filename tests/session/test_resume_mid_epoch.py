"""Resume in the middle of an epoch, with dropout: the resumed run must continue the uninterrupted one bit for bit.

Creating a DataLoader iterator draws its workers' base seed from a generator; from torch's global
one when the loader has none, which shifts every later dropout mask of a resumed run. The
Session's loaders own that draw (issue 23, break 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multigpu import Checkpointer
from multigpu.session import Session

STEPS_PER_EPOCH = 6  # 24 samples, global batch 4


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(24, 5, generator=gen), torch.randint(0, 3, (24,), generator=gen))


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


def _run(folder: Path, *, total: int, stop_at: int | None, stateful: bool, own_loader: bool) -> dict[str, Any]:
    """Train ``total`` steps (resuming from ``folder`` when it holds a checkpoint); save and stop at ``stop_at``."""
    losses: dict[int, float] = {}
    with Session(strategy="single", seed=0) as session:
        model = session.setup_model(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if own_loader:
            loader = session.setup_dataloader(DataLoader(_data(), batch_size=4, shuffle=True))
        else:
            loader = session.build_loader(_data(), batch_size=4)
        checkpointer = Checkpointer(folder=folder)
        with_loader: dict[str, Any] = {"loader": loader} if stateful else {}
        resumed = checkpointer.resume(model=model, optimizer=optimizer, **with_loader)
        step = resumed.step if resumed else 0
        skip = 0
        if resumed and not stateful:  # the bookkeeping a user did before loaders had a state
            loader.set_epoch(resumed.epoch)
            skip = resumed.data_position["batch"]
        while step < total:
            for i, (x, y) in enumerate(session.batches(loader)):
                if i < skip:
                    continue
                with session.micro_step(model):
                    loss = nn.functional.cross_entropy(model(x), y)
                    session.backward(loss)
                session.step(optimizer)
                step += 1
                losses[step] = float(loss.detach())
                if step == stop_at:
                    epoch, batch = divmod(step, STEPS_PER_EPOCH)
                    checkpointer.save(
                        step=step,
                        model=model,
                        optimizer=optimizer,
                        epoch=epoch,
                        data_position={"batch": batch},
                        **with_loader,
                    )
                    return {"losses": losses}
                if step == total:
                    break
            skip = 0
        return {"losses": losses, "weights": {k: v.clone() for k, v in session.unwrap(model).state_dict().items()}}


def _check_resume(tmp_path: Path, *, stateful: bool, own_loader: bool) -> None:
    whole = _run(tmp_path / "whole", total=16, stop_at=None, stateful=stateful, own_loader=own_loader)
    first = _run(tmp_path / "split", total=16, stop_at=8, stateful=stateful, own_loader=own_loader)  # epoch 1, batch 2
    rest = _run(tmp_path / "split", total=16, stop_at=None, stateful=stateful, own_loader=own_loader)
    assert first["losses"] == {k: v for k, v in whole["losses"].items() if k <= 8}
    assert rest["losses"] == {k: v for k, v in whole["losses"].items() if k > 8}
    for name, value in whole["weights"].items():
        assert torch.equal(value, rest["weights"][name]), name


def test_resume_mid_epoch_with_dropout_is_bit_exact_with_data_position_bookkeeping(tmp_path: Path) -> None:
    _check_resume(tmp_path, stateful=False, own_loader=False)


def test_resume_mid_epoch_with_dropout_is_bit_exact_with_the_loaders_state(tmp_path: Path) -> None:
    _check_resume(tmp_path, stateful=True, own_loader=False)


def test_resume_mid_epoch_of_a_users_own_loader_is_bit_exact(tmp_path: Path) -> None:
    _check_resume(tmp_path, stateful=True, own_loader=True)
