"""Step folders are parsed strictly; keep-last-N deletes, and a re-save replaces, only checkpoints this library wrote."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.errors import CheckpointError
from tests.checkpoint._models import filled


def _copy_of_a_checkpoint(tmp_path: Path, name: str) -> Path:
    """A complete checkpoint folder (written by a Checkpointer elsewhere) under ``name``."""
    source = ckpt.Checkpointer(folder=tmp_path / "elsewhere").save(step=1, model=filled(9.0))
    target = tmp_path / "run" / name
    target.parent.mkdir(exist_ok=True)
    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize(
    "stray",
    [
        "step-99999999999999999999",  # beyond int64
        "step-42",  # not zero-padded: not a name a Checkpointer writes
        "step-0000000٥",  # an Arabic-Indic digit: Python's \d and int() accept it
        "step-00000042.bak",
        "step-000000042",  # a leading zero too many
    ],
)
def test_a_stray_folder_is_ignored_and_never_deleted(tmp_path: Path, stray: str) -> None:
    stray_folder = _copy_of_a_checkpoint(tmp_path, stray)
    checkpointer = ckpt.Checkpointer(folder=tmp_path / "run", keep_last=1)
    with pytest.warns(RuntimeWarning, match=rf"not complete checkpoints: {stray}"):
        written = checkpointer.save(step=5, model=filled(1.0))
    assert written == tmp_path / "run" / "step-00000005" and written.is_dir()
    with pytest.warns(RuntimeWarning):
        assert checkpointer.latest() == written
    assert stray_folder.is_dir() and (stray_folder / "model.safetensors").is_file()
    resumed_into = nn.Linear(3, 2)
    with pytest.warns(RuntimeWarning):
        checkpointer.resume(model=resumed_into)
    assert bool((resumed_into.weight == 1.0).all())


def test_keep_last_never_deletes_the_checkpoint_just_written(tmp_path: Path) -> None:
    # A later step from an earlier run in the same folder: the new, lower step must survive.
    checkpointer = ckpt.Checkpointer(folder=tmp_path, keep_last=1)
    checkpointer.save(step=100, model=filled(9.0))
    with pytest.warns(RuntimeWarning, match=r"checkpoints of later steps \(\[100\]\) than the one just saved \(5\)"):
        written = checkpointer.save(step=5, model=filled(1.0))
    assert written.is_dir() and checkpointer.steps() == [5, 100]


def test_keep_last_deletes_only_what_a_checkpointer_wrote(tmp_path: Path) -> None:
    # A folder with a checkpoint name whose weights were not written by a Checkpointer (no step in the header).
    foreign = tmp_path / "step-00000001"
    foreign.mkdir()
    ckpt.save(filled(7.0), foreign / "model.safetensors")
    torch.save({"mine": True}, foreign / "state.pt")
    checkpointer = ckpt.Checkpointer(folder=tmp_path, keep_last=1)
    for step in (2, 3):
        checkpointer.save(step=step, model=filled(float(step)))
    assert foreign.is_dir() and (foreign / "state.pt").is_file()
    assert checkpointer.steps() == [1, 3]  # step 2 was ours and older than 3: pruned


def test_a_symlinked_step_folder_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(ckpt.Checkpointer(folder=tmp_path / "elsewhere").save(step=1, model=filled(9.0)), outside)
    run = tmp_path / "run"
    run.mkdir()
    (run / "step-00000001").symlink_to(outside, target_is_directory=True)
    checkpointer = ckpt.Checkpointer(folder=run, keep_last=1)
    with pytest.warns(RuntimeWarning, match=r"step-00000001"):
        checkpointer.save(step=2, model=filled(2.0))
    assert sorted(p.name for p in outside.iterdir()) == ["manifest.json", "model.safetensors", "state.pt"]
    with pytest.warns(RuntimeWarning):
        assert checkpointer.latest() == run / "step-00000002"


def test_large_steps_round_trip(tmp_path: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path, keep_last=None)
    for step in (99_999_999, 100_000_000, 2**63 - 1):
        checkpointer.save(step=step, model=filled(1.0))
    assert checkpointer.steps() == [99_999_999, 100_000_000, 2**63 - 1]
    resumed = checkpointer.resume(model=nn.Linear(3, 2))
    assert resumed is not None and resumed.step == 2**63 - 1


def _foreign_folder(path: Path) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("mine")


def _foreign_checkpoint(path: Path) -> None:  # complete, but its weights record no step
    path.mkdir()
    ckpt.save(filled(7.0), path / "model.safetensors")
    torch.save({"mine": True}, path / "state.pt")


def _file(path: Path) -> None:
    path.write_text("mine")


def _link(path: Path) -> None:
    outside = path.parent.parent / "outside"
    _foreign_folder(outside)
    path.symlink_to(outside, target_is_directory=True)


@pytest.mark.parametrize(
    ("occupy", "what"),
    [
        (_foreign_folder, "a folder without a complete checkpoint"),
        (_foreign_checkpoint, "a checkpoint no Checkpointer wrote for this step"),
        (_file, "not a folder"),
        (_link, "a symbolic link"),
    ],
    ids=["someone's folder", "foreign checkpoint", "file", "link"],
)
def test_saving_a_step_whose_name_is_taken_by_something_else_loses_nothing(
    tmp_path: Path, occupy: Callable[[Path], None], what: str
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    taken = run / "step-00000005"
    occupy(taken)
    before = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in sorted(tmp_path.rglob("*"))
        if p.is_file() and p.name != ".multigpu.lock"
    }
    checkpointer = ckpt.Checkpointer(folder=run)
    with pytest.raises(
        CheckpointError, match=rf"cannot save step 5: .*step-00000005' exists and is {what}.*Move it away"
    ):
        checkpointer.save(step=5, model=filled(1.0))
    after = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in sorted(tmp_path.rglob("*"))
        if p.is_file() and p.name != ".multigpu.lock"
    }
    assert after == before  # nothing replaced, no temporary left
    assert sorted(p.name for p in run.iterdir()) == [".multigpu.lock", "step-00000005"]
    assert checkpointer.save(step=6, model=filled(1.0)).is_dir()  # the folder stays usable


def test_a_lock_that_is_not_a_file_is_named_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / ".multigpu.lock").mkdir()
    with pytest.raises(
        CheckpointError, match=r"cannot take the lock .*\.multigpu\.lock.*remove what sits under that name"
    ):
        ckpt.Checkpointer(folder=tmp_path, lock_timeout_s=5).save(step=1, model=filled(1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".multigpu.lock"]
