"""A saved loader position resumes only into a loader where it means the same batches (issue 29).

``Checkpointer.save(loader=...)`` records the epoch and batch, and what they count in: the global
batch, the dataset's length, shuffle, seed and drop_last. ``resume(loader=...)`` into a loader where
any of these differ is refused, naming both values and the fix, before anything changes; a
checkpoint saved before these were recorded resumes as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multigpu import Checkpointer
from multigpu.errors import CheckpointError, ConfigError
from multigpu.runtime.data import EpochLoader, ShardSpec, build_epoch_loader
from multigpu.runtime.loaders import shard_dataloader

SETUP = {"samples": 20, "global_batch": 4, "shuffle": True, "seed": 0, "drop_last": True}


def _loader(**changes: Any) -> EpochLoader[Any]:
    setup = {**SETUP, **changes}
    data = TensorDataset(torch.arange(setup["samples"]))
    return build_epoch_loader(
        data,
        global_batch=setup["global_batch"],
        shard=ShardSpec(),
        shuffle=setup["shuffle"],
        seed=setup["seed"],
        drop_last=setup["drop_last"],
    )


def _samples(batches: Any) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


def _saved_mid_epoch(folder: Path) -> tuple[Checkpointer, list[list[int]]]:
    """A checkpoint at epoch 1, batch 2 of a 5-batch epoch; returns the batches the run trains after it."""
    model, loader = nn.Linear(2, 1), _loader()
    list(loader)  # epoch 0
    epoch_1 = iter(loader)
    next(epoch_1), next(epoch_1)
    checkpointer = Checkpointer(folder=folder)
    checkpointer.save(step=7, model=model, epoch=1, loader=loader)
    return checkpointer, _samples(epoch_1)


def test_an_exact_resume_continues_with_the_batches_the_run_had_left(tmp_path: Path) -> None:
    checkpointer, rest = _saved_mid_epoch(tmp_path)
    assert len(rest) == 3
    loader = _loader()
    resumed = checkpointer.resume(model=nn.Linear(2, 1), loader=loader)
    assert resumed is not None and resumed.step == 7
    assert _samples(loader) == rest
    assert _samples(loader) == _samples(_epoch(2))  # the next epoch whole


def _epoch(number: int) -> list[Any]:
    fresh = _loader()
    fresh.set_epoch(number)
    return list(fresh)


REFUSED = {
    "another global batch": (
        {"global_batch": 8},
        r"saved for global_batch=4, but this loader has global_batch=8.*Build the loader as the saved run did "
        r"\(batch_size=4 \(the global batch\)\), or resume without loader=",
    ),
    "a shorter dataset": (
        {"samples": 12},
        r"saved for dataset_length=20, but this loader has dataset_length=12.*the same dataset, of 20 samples",
    ),
    "no shuffle": ({"shuffle": False}, r"saved for shuffle=True, but this loader has shuffle=False.*shuffle=True"),
    "another seed": ({"seed": 1}, r"saved for seed=0, but this loader has seed=1.*seed=0"),
    "a short last batch kept": (
        {"drop_last": False},
        r"saved for drop_last=True, but this loader has drop_last=False.*drop_last=True",
    ),
    "batch and dataset": (
        {"global_batch": 2, "samples": 10},
        r"saved for global_batch=4, dataset_length=20, but this loader has global_batch=2, dataset_length=10",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_resume_into_a_loader_over_other_batches_is_refused_naming_both_values(tmp_path: Path, case: str) -> None:
    changes, message = REFUSED[case]
    checkpointer, _ = _saved_mid_epoch(tmp_path)
    model, loader = nn.Linear(2, 1), _loader(**changes)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=r"state\.pt': entry 'data_position'\['loader'\] does not fit .*" + message
    ):
        checkpointer.resume(model=model, loader=loader)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing applied
    saved = checkpointer.resume(model=nn.Linear(2, 1))
    assert saved is not None
    with pytest.raises(ConfigError, match=message):  # the loader's own load_state_dict refuses it too
        loader.load_state_dict(saved.data_position["loader"])
    assert loader.epoch == 0 and loader.pending_skip == 0


class _Recorded:
    """Stands for a loader whose ``state_dict()`` is whatever a checkpoint holds (an older multigpu's, a crafted one)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def test_a_checkpoint_from_before_the_data_was_recorded_still_resumes(tmp_path: Path) -> None:
    checkpointer = Checkpointer(folder=tmp_path)
    checkpointer.save(step=7, model=nn.Linear(2, 1), loader=_Recorded({"epoch": 1, "batch": 2}))  # an older save
    loader = _loader()
    assert checkpointer.resume(model=nn.Linear(2, 1), loader=loader) is not None
    assert _samples(loader) == _samples(_epoch(1))[2:]


def test_an_old_position_past_this_loaders_epoch_is_refused(tmp_path: Path) -> None:
    checkpointer = Checkpointer(folder=tmp_path)
    checkpointer.save(step=7, model=nn.Linear(2, 1), loader=_Recorded({"epoch": 1, "batch": 9}))
    with pytest.raises(CheckpointError, match=r"at batch 9 of epoch 1, but an epoch of this loader has 5 batches"):
        checkpointer.resume(model=nn.Linear(2, 1), loader=_loader())


CRAFTED = {
    "a list where the mapping belongs": ([1, 2], r"a loader state is a mapping with 'epoch' and 'batch', got \[1, 2\]"),
    "a huge epoch": ({"epoch": 1e999, "batch": 0}, r"needs ints 'epoch' and 'batch' >= 0, got \{'epoch': inf"),
    "an epoch past int64": ({"epoch": 2**70, "batch": 0}, r"needs ints 'epoch' and 'batch' >= 0"),
    "data a list": ({"epoch": 0, "batch": 0, "data": [4, 20]}, r"'data' is \[4, 20\]; expected a mapping of"),
    "data of unknown names": ({"epoch": 0, "batch": 0, "data": {"x": 1}}, r"'data' is \{'x': 1\}; expected"),
    "data a tensor value": (
        {"epoch": 0, "batch": 0, "data": {"global_batch": torch.tensor([4, 4])}},
        r"saved for global_batch=tensor\(\[4, 4\]\), but this loader has global_batch=4",
    ),
    "deep nesting": ({"epoch": 0, "batch": 0, "data": {"seed": [[[[[[0]]]]]]}}, r"saved for seed=\[\[\[\[\[\[0\]"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_loader_state_is_refused_before_anything_changes(tmp_path: Path, case: str) -> None:
    state, message = CRAFTED[case]
    checkpointer = Checkpointer(folder=tmp_path)
    checkpointer.save(step=7, model=nn.Linear(2, 1), loader=_Recorded(state))
    model, loader = nn.Linear(2, 1), _loader()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"state\.pt': entry 'data_position'\['loader'\].*" + message):
        checkpointer.resume(model=model, loader=loader)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_damaged_generator_state_is_refused_before_anything_changes(tmp_path: Path) -> None:
    def own() -> EpochLoader[Any]:
        data = TensorDataset(torch.arange(20))
        return shard_dataloader(DataLoader(data, batch_size=4, generator=torch.Generator()), ShardSpec(), seed=0)

    state = {**own().state_dict(), "generator": torch.zeros(7, dtype=torch.uint8)}
    checkpointer = Checkpointer(folder=tmp_path)
    checkpointer.save(step=7, model=nn.Linear(2, 1), loader=_Recorded(state))
    model = nn.Linear(2, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"'generator' is tensor\(.*not a state of the loader's cpu generator"):
        checkpointer.resume(model=model, loader=own())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
