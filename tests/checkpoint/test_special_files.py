"""A pipe, a device or a folder where a checkpoint file is expected: a CheckpointError naming it, at once.

``open()`` of a named pipe waits for a writer forever and ``/dev/zero`` never ends, so a reader
that opens whatever the path names hangs the run (or a resume of every rank). Each case runs under
a short pytest timeout: a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.checkpoint.atomic import STATE_FILE
from multigpu.checkpoint.dcp import MANIFEST_FILE, METADATA_FILE
from multigpu.cli.main import main
from multigpu.errors import CheckpointError
from tests.checkpoint import _sharded as sh
from tests.checkpoint import _training as tr

pytestmark = pytest.mark.timeout(30)

NOT_REGULAR = r"named pipe \(FIFO\), not a regular file; give the path of a checkpoint file"


def _fifo(path: Path) -> Path:
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("name", ["w.safetensors", "w.pt"])
def test_loading_weights_from_a_pipe_is_refused_at_once(tmp_path: Path, name: str) -> None:
    with pytest.raises(CheckpointError, match=rf"cannot read .*{name}'?: it is a {NOT_REGULAR}"):
        ckpt.load(nn.Linear(2, 2), _fifo(tmp_path / name))


def test_loading_weights_through_a_link_to_a_device_is_refused(tmp_path: Path) -> None:
    (tmp_path / "w.safetensors").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"w\.safetensors'?: it is a character device, not a regular file"):
        ckpt.load(nn.Linear(2, 2), tmp_path / "w.safetensors")


def test_a_one_file_step_whose_state_is_a_pipe_is_skipped_for_the_previous_step(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    checkpointer.save(step=1, model=model)
    checkpointer.save(step=2, model=model)
    _fifo(tmp_path / "step-00000002" / STATE_FILE)
    with pytest.warns(RuntimeWarning, match="step-00000002"):
        resumed = checkpointer.resume(model=model)
    assert resumed is not None and resumed.step == 1


@pytest.fixture
def sharded_steps(one_rank_group: None, tmp_path: Path) -> Path:
    """A folder with sharded checkpoints of steps 1 and 2."""
    tr.seed_everything(100)
    run = sh.build_run(sh.sharded_model())
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    for step in (1, 2):
        sh.train_step(run, step)
        checkpointer.save(step=step, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler)
    return tmp_path


def _pipe_for(name: str) -> Callable[[Path], Path]:
    return lambda folder: _fifo(folder / name)


def _link_to_a_pipe(folder: Path) -> Path:
    shard = folder / "__0_0.distcp"
    shutil.move(shard, folder.parent / "moved.distcp")
    _fifo(folder.parent / "pipe")
    shard.symlink_to(folder.parent / "pipe")
    return shard


@pytest.mark.parametrize(
    "harm",
    [_pipe_for(STATE_FILE), _pipe_for(METADATA_FILE), _pipe_for(MANIFEST_FILE), _link_to_a_pipe],
    ids=["state.pt", ".metadata", "manifest.json", "shard linked to a pipe"],
)
def test_resuming_a_sharded_step_holding_a_pipe_is_refused_at_once(
    sharded_steps: Path, harm: Callable[[Path], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = sharded_steps / "step-00000002"
    pipe = harm(folder)
    run = sh.build_run(sh.sharded_model())
    before = sh.full_weights(run.model)
    with pytest.raises(CheckpointError, match=rf"{pipe.name}.*(named pipe \(FIFO\)|has 0 bytes)"):
        ckpt.Checkpointer(folder=sharded_steps).resume(model=run.model, optimizer=run.optimizer, path=folder)
    assert all(v.equal(before[k]) for k, v in sh.full_weights(run.model).items())
    capsys.readouterr()
    for argv in (["ckpt", "inspect", str(folder)], ["ckpt", "convert", str(folder), str(sharded_steps / "w.pt")]):
        if pipe.name == STATE_FILE:  # the weights alone do not need it
            assert main(argv) == 0
            continue
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and pipe.name in err, err


def test_a_sharded_step_missing_its_manifest_says_so(sharded_steps: Path) -> None:
    folder = sharded_steps / "step-00000002"
    (folder / MANIFEST_FILE).unlink()
    run = sh.build_run(sh.sharded_model())
    with pytest.raises(CheckpointError, match=r"cannot read .*manifest\.json'?: No such file"):
        ckpt.Checkpointer(folder=sharded_steps).resume(model=run.model, optimizer=run.optimizer, path=folder)


def test_a_step_whose_weights_are_a_dangling_link_is_named_by_inspect_and_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by its storage (the link's name is there), read whole: a CheckpointError, not a FileNotFoundError."""
    folder = ckpt.Checkpointer(folder=tmp_path).save(step=1, model=nn.Linear(2, 2))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(tmp_path / "gone")
    assert main(["ckpt", "inspect", str(folder)]) == 1
    assert "is not a complete checkpoint folder" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=r"step-00000001' is not a complete checkpoint folder: .*is missing"):
        ckpt.load(nn.Linear(2, 2), folder)
