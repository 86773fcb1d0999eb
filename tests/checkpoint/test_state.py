from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.checkpoint.atomic import LOCK_NAME, temporary_name
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.errors import CheckpointError, ConfigError
from tests.checkpoint import _training as tr

TOTAL_STEPS = 12
CRASH_AFTER = 7  # mid-epoch: epoch 1, batch 3 of 4


def _uninterrupted() -> tuple[list[float], nn.Module]:
    tr.seed_everything(7)
    parts = tr.build_parts()
    losses = [tr.train_step(parts, step) for step in range(TOTAL_STEPS)]
    return losses, parts.model


def test_resume_from_step_k_reproduces_the_uninterrupted_run_bitwise(tmp_path: Path) -> None:
    expected_losses, expected_model = _uninterrupted()

    checkpointer = ckpt.Checkpointer(folder=tmp_path, keep_last=2)
    tr.seed_everything(7)
    parts = tr.build_parts()
    losses = []
    for step in range(CRASH_AFTER):
        losses.append(tr.train_step(parts, step))
        epoch, batch = divmod(step + 1, tr.BATCHES_PER_EPOCH)
        checkpointer.save(
            step=step + 1,
            model=parts.model,
            optimizer=parts.optimizer,
            scheduler=parts.scheduler,
            scaler=parts.scaler,
            epoch=epoch,
            data_position={"batch": batch},
        )
    del parts  # the "crash": everything in memory is gone

    tr.seed_everything(999)  # a new process starts with other random states and other weights
    fresh = tr.build_parts(nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.2), nn.Linear(48, 10)))
    resumed = checkpointer.resume(
        model=fresh.model, optimizer=fresh.optimizer, scheduler=fresh.scheduler, scaler=fresh.scaler
    )
    assert resumed is not None
    assert (resumed.step, resumed.epoch, resumed.data_position) == (CRASH_AFTER, 1, {"batch": 3})
    for step in range(resumed.step, TOTAL_STEPS):
        losses.append(tr.train_step(fresh, step))

    assert losses == expected_losses  # bitwise: floats compared exactly
    for (name, got), want in zip(fresh.model.state_dict().items(), expected_model.state_dict().values()):
        assert torch.equal(got, want), name
    assert checkpointer.steps() == [CRASH_AFTER - 1, CRASH_AFTER]  # keep_last=2


def test_resume_without_a_checkpoint_returns_none(tmp_path: Path) -> None:
    assert ckpt.Checkpointer(folder=tmp_path / "empty").resume(model=nn.Linear(2, 2)) is None


def test_find_latest_ignores_temporary_and_incomplete_folders(tmp_path: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path, keep_last=None)
    model = nn.Linear(3, 2)
    checkpointer.save(step=4, model=model)
    checkpointer.save(step=10, model=model)
    # What an interrupted save of step 20 leaves behind, and a step folder missing its state file.
    leftover = temporary_name(tmp_path / "step-00000020")
    leftover.mkdir()
    (leftover / ckpt.one_file.MODEL_FILE).write_bytes(b"partial")
    (tmp_path / "step-00000030").mkdir()
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-00000010"
    assert checkpointer.steps() == [4, 10]


def test_state_file_loads_weights_only(tmp_path: Path) -> None:
    parts = tr.build_parts()
    tr.train_step(parts, 0)
    folder = ckpt.Checkpointer(folder=tmp_path).save(
        step=1, model=parts.model, optimizer=parts.optimizer, scheduler=parts.scheduler, scaler=parts.scaler
    )
    state = torch.load(folder / ckpt.state.STATE_FILE, weights_only=True)
    assert state["step"] == 1 and state["optimizer"]["state"]


def test_non_tensor_data_position_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data_position\['sampler'\] is a Generator"):
        ckpt.Checkpointer(folder=tmp_path).save(
            step=1, model=nn.Linear(2, 2), data_position={"sampler": torch.Generator()}
        )


def test_keep_last_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"keep_last=0 must be a positive int or None"):
        ckpt.Checkpointer(folder=tmp_path, keep_last=0)


def test_resume_with_an_optimizer_the_checkpoint_lacks_says_so(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    checkpointer.save(step=1, model=model)
    with pytest.raises(CheckpointError, match=r"holds no optimizer state.*pass optimizer=None"):
        checkpointer.resume(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    checkpointer.save(step=3, model=first)
    checkpointer.save(step=3, model=second)
    loaded = nn.Linear(2, 2)
    checkpointer.resume(model=loaded)
    assert torch.equal(loaded.weight, second.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME, "step-00000003"]


def test_unsafe_state_file_is_refused_unless_allowed(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    folder = ckpt.Checkpointer(folder=tmp_path).save(step=1, model=model)
    state = load_torch_file(folder / ckpt.state.STATE_FILE)
    state["extra"] = {"hook": _Marker()}
    torch.save(state, folder / ckpt.state.STATE_FILE)
    with pytest.raises(CheckpointError, match=r"needs arbitrary unpickling.*allow_unsafe_pickle=True"):
        ckpt.Checkpointer(folder=tmp_path).resume(model=model)
    resumed = ckpt.Checkpointer(folder=tmp_path).resume(model=model, allow_unsafe_pickle=True)
    assert resumed is not None and isinstance(resumed.extra["hook"], _Marker)


class _Marker:
    pass


@pytest.mark.cuda
def test_cuda_random_state_is_saved_and_restored(tmp_path: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    checkpointer.save(step=1, model=nn.Linear(2, 2))
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(123)
    checkpointer.resume(model=nn.Linear(2, 2))
    assert torch.equal(torch.rand(4, device="cuda"), expected)
