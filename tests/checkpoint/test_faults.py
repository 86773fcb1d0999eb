"""Faults during a save: killed mid-write, disk full, folder not writable. The previous checkpoint survives."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.checkpoint.atomic import LOCK_NAME, is_temporary
from multigpu.cli.main import main
from multigpu.errors import CheckpointError
from tests.launching import start_python

WORKER = Path(__file__).parent / "workers" / "save_until_killed.py"


def _kill_during_second_save(mode: str, folder: Path) -> list[Path]:
    child = start_python(str(WORKER), mode, str(folder))
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "saved 1"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            leftovers = [p for p in folder.iterdir() if is_temporary(p)]
            if leftovers:
                os.kill(child.pid, signal.SIGKILL)  # no cleanup handler can run
                child.wait(timeout=10)
                return leftovers
            time.sleep(0.001)
        raise AssertionError("the second save never started")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


@pytest.mark.multiprocess
def test_sigkill_during_a_weights_save_leaves_the_previous_file(tmp_path: Path) -> None:
    leftovers = _kill_during_second_save("weights", tmp_path)
    assert any(p.exists() for p in leftovers), "the kill must land in the middle of the save"
    model = nn.Linear(4096, 4096)
    ckpt.load(model, tmp_path / "model.safetensors")
    assert bool((model.weight == 1.0).all())  # the first save, whole


@pytest.mark.multiprocess
def test_sigkill_during_a_state_save_leaves_the_previous_step_as_latest(tmp_path: Path) -> None:
    leftovers = _kill_during_second_save("state", tmp_path)
    assert any(p.exists() for p in leftovers), "the kill must land in the middle of the save"
    checkpointer = ckpt.Checkpointer(folder=tmp_path, keep_last=2)
    assert checkpointer.latest() == tmp_path / "step-00000001"
    model = nn.Linear(4096, 4096)
    resumed = checkpointer.resume(model=model)
    assert resumed is not None and resumed.step == 1 and bool((model.weight == 1.0).all())
    # The next save clears what the killed process left behind.
    checkpointer.save(step=2, model=model)
    assert not any(p.exists() for p in leftovers)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME, "step-00000001", "step-00000002"]


def _previous_then_big(folder: Path) -> tuple[ckpt.Checkpointer, nn.Module]:
    checkpointer = ckpt.Checkpointer(folder=folder, keep_last=2)
    small = nn.Linear(512, 512)  # 1 MiB
    checkpointer.save(step=1, model=small)
    ckpt.save(small, folder / "weights.safetensors")
    return checkpointer, small


def _assert_previous_intact(folder: Path, checkpointer: ckpt.Checkpointer, small: nn.Module) -> None:
    assert checkpointer.latest() == folder / "step-00000001"
    again = nn.Linear(512, 512)
    assert checkpointer.resume(model=again) is not None
    assert torch.equal(again.weight, small.weight)
    ckpt.load(again, folder / "weights.safetensors")
    assert torch.equal(again.weight, small.weight)
    assert not [p for p in folder.iterdir() if is_temporary(p)]


SIZE_LIMIT_WORKER = Path(__file__).parent / "workers" / "save_past_size_limit.py"


@pytest.mark.multiprocess
def test_a_file_size_limit_is_named_as_one_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    # The kernel refuses writes past RLIMIT_FSIZE with EFBIG half-way through the file, where a
    # full disk refuses them with ENOSPC; the limit is set in a child process of its own.
    child = start_python(str(SIZE_LIMIT_WORKER), str(tmp_path), str(2 << 20))
    try:
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert child.returncode == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("refused: ") for line in lines), out
    for line, name in zip(lines, ("step-00000002", "weights.safetensors", "weights.pt")):
        assert name in line
        assert "File too large (errno 27): a file-size limit was hit, not a full disk" in line
        assert f"may write files of at most {2 << 20} bytes (RLIMIT_FSIZE, ulimit -f)" in line
        assert "previous checkpoint is unchanged. Raise the limit where the run starts (ulimit -f" in line
        assert "is full" not in line
    small = nn.Linear(512, 512)
    small.weight.data.fill_(1.0)
    checkpointer = ckpt.Checkpointer(folder=tmp_path, keep_last=2)
    _assert_previous_intact(tmp_path, checkpointer, small)
    again = nn.Linear(512, 512)
    ckpt.load(again, tmp_path / "weights.pt")
    assert bool((again.weight == 1.0).all())


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A real 4 MiB file system (tmpfs); skipped where this process may not mount one."""
    mount_point = Path(tempfile.mkdtemp())
    done = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)], capture_output=True, timeout=10
        )
        if shutil.which("mount") and os.geteuid() == 0
        else None
    )
    if done is None or done.returncode != 0:
        mount_point.rmdir()
        pytest.skip("mounting a small tmpfs needs root and mount permission")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True, timeout=10)
        mount_point.rmdir()


@pytest.mark.multiprocess
def test_full_disk_raises_and_keeps_the_previous_checkpoint(small_tmpfs: Path) -> None:
    checkpointer, small = _previous_then_big(small_tmpfs)
    with pytest.raises(CheckpointError, match=r"No space left on device.*is full"):
        checkpointer.save(step=2, model=nn.Linear(512, 2048))  # 4 MiB on a disk with ~2 MiB free
    _assert_previous_intact(small_tmpfs, checkpointer, small)


@contextlib.contextmanager
def _unprivileged() -> Iterator[None]:
    # root ignores folder permissions; act as 'nobody' for the save so they apply (in CI, as a
    # normal user, this is a no-op).
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_unwritable_folder_raises_and_keeps_the_previous_checkpoint() -> None:
    root = Path(tempfile.mkdtemp())
    try:
        root.chmod(0o755)
        folder = root / "ckpt"
        folder.mkdir()
        checkpointer, small = _previous_then_big(folder)
        folder.chmod(0o555)
        with _unprivileged():
            with pytest.raises(
                CheckpointError, match=r"folder '.*ckpt' is not writable.*previous checkpoint is unchanged"
            ):
                checkpointer.save(step=2, model=small)
            with pytest.raises(CheckpointError, match=r"folder '.*ckpt' is not writable"):
                ckpt.save(small, folder / "weights.safetensors")
        folder.chmod(0o755)
        _assert_previous_intact(folder, checkpointer, small)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_missing_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"folder '.*nowhere' does not exist"):
        ckpt.save(nn.Linear(2, 2), tmp_path / "nowhere" / "w.safetensors")


@pytest.mark.parametrize("name", ["w.safetensors", "w.pt"])
def test_saving_onto_a_folder_is_named_with_the_fix(tmp_path: Path, name: str) -> None:
    (tmp_path / name).mkdir()
    (tmp_path / name / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=rf"{name}': it is an existing folder\. Give the path of a file"):
        ckpt.save(nn.Linear(2, 2), tmp_path / name)
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted([name, "keep.txt"])  # no temporary left


@pytest.mark.parametrize("path", [".", "", "/", "..", "sub/.."])
def test_saving_onto_a_path_that_names_a_folder_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # '.' and '/' raised pathlib's ValueError ("has an empty name"); '..' wrote a temporary, then failed with EBUSY
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"it names a folder, not a file\. Give the path of a file"):
        ckpt.save(nn.Linear(2, 2), path)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["sub"]
    weights = ckpt.save(nn.Linear(2, 2), tmp_path / "sub" / "w.safetensors")
    assert main(["ckpt", "convert", str(weights), path or "."]) != 0  # the CLI: its one-line error, no traceback
