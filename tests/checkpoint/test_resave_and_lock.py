"""Re-saving a step keeps a complete copy findable at every instant; one saver per folder; no stale temporaries."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.errors import CheckpointError
from tests.checkpoint._models import filled
from tests.launching import finished_pid


def _value_of(checkpointer: ckpt.Checkpointer) -> float:
    model = nn.Linear(3, 2)
    assert checkpointer.resume(model=model) is not None
    return float(model.weight[0, 0].detach())


def _visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != ".multigpu.lock")


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "aside-fallback"])
def test_resaving_a_step_replaces_it_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    from multigpu.checkpoint import atomic

    monkeypatch.setattr(atomic, "use_exchange", exchange)
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    checkpointer.save(step=3, model=filled(1.0))
    checkpointer.save(step=3, model=filled(2.0))
    assert _value_of(checkpointer) == 2.0
    assert _visible(tmp_path) == ["step-00000003"]


def test_exchange_swaps_two_folders_in_one_step(tmp_path: Path) -> None:
    from multigpu.checkpoint.atomic import exchange

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("b")
    if not exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this kernel or file system has no renameat2(RENAME_EXCHANGE); the fallback is tested above")
    assert (tmp_path / "a" / "x").read_text() == "b" and (tmp_path / "b" / "x").read_text() == "a"


def test_a_replacement_interrupted_between_its_renames_keeps_the_old_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from multigpu.checkpoint import atomic

    monkeypatch.setattr(atomic, "use_exchange", False)
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    checkpointer.save(step=3, model=filled(1.0))
    real_rename = os.rename
    calls = []

    def rename_then_die(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        calls.append((src, dst))
        if len(calls) == 3:  # 1: the new step's tmp onto the name (refused), 2: old step aside, 3: new one in
            raise KeyboardInterrupt("killed between the two renames")
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        checkpointer.save(step=3, model=filled(2.0))
    monkeypatch.setattr(atomic.os, "rename", real_rename)

    assert not (tmp_path / "step-00000003").exists()  # the name is empty at this instant...
    assert checkpointer.steps() == [3]  # ...and the old step is still found, under its aside name
    assert _value_of(checkpointer) == 1.0
    checkpointer.save(step=4, model=filled(4.0))  # the next save puts the aside back
    assert _visible(tmp_path) == ["step-00000003", "step-00000004"]
    assert _value_of(ckpt.Checkpointer(folder=tmp_path)) == 4.0


def test_a_held_folder_lock_names_its_holder(tmp_path: Path) -> None:
    from multigpu.checkpoint.atomic import folder_lock

    checkpointer = ckpt.Checkpointer(folder=tmp_path, lock_timeout_s=0.3)
    checkpointer.save(step=1, model=filled(1.0))
    with folder_lock(tmp_path, timeout_s=1):
        with pytest.raises(
            CheckpointError, match=rf"another process is saving into .*host={socket.gethostname()} pid={os.getpid()}"
        ):
            checkpointer.save(step=2, model=filled(2.0))
    assert checkpointer.steps() == [1]
    checkpointer.save(step=2, model=filled(2.0))  # released: saves again
    assert checkpointer.steps() == [1, 2]


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "1", True])
def test_lock_timeout_is_checked(tmp_path: Path, timeout: object) -> None:
    from multigpu.errors import ConfigError

    with pytest.raises(ConfigError, match=r"lock_timeout_s=.* must be a positive number of seconds"):
        ckpt.Checkpointer(folder=tmp_path, lock_timeout_s=timeout)  # type: ignore[arg-type]


@pytest.mark.multiprocess
def test_a_weights_save_removes_temporaries_of_killed_saves_of_that_file(tmp_path: Path) -> None:
    host = socket.gethostname().replace(".", "_")
    dead = tmp_path / f".w.safetensors.tmp-{host}-{finished_pid()}-0badc0de"
    alive = tmp_path / f".w.safetensors.tmp-{host}-{os.getpid()}-0badc0de"  # a save still running
    other_file = tmp_path / f".v.safetensors.tmp-{host}-{finished_pid()}-0badc0de"
    other_host = tmp_path / f".w.safetensors.tmp-elsewhere-{finished_pid()}-0badc0de"
    for leftover in (dead, alive, other_file, other_host):
        leftover.write_bytes(b"partial")
    ckpt.save(filled(1.0), tmp_path / "w.safetensors")
    assert not dead.exists()
    assert alive.exists() and other_file.exists() and other_host.exists()


def test_a_weights_file_replaced_while_read_is_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process re-saves the file (atomic rename) between our header check and our data read.
    from multigpu.checkpoint import formats

    path = ckpt.save(filled(1.0), tmp_path / "w.safetensors")
    checked = formats.checked_safetensors_header

    def check_then_replace(*args: object, **kwargs: object) -> object:
        header = checked(*args, **kwargs)  # type: ignore[arg-type]
        ckpt.save(filled(2.0), path)
        return header

    monkeypatch.setattr(formats, "checked_safetensors_header", check_then_replace)
    model = nn.Linear(3, 2)
    ckpt.load(model, path)  # the file as it was opened: header and data of one version
    assert bool((model.weight == 1.0).all())


def test_a_torch_file_replaced_after_its_check_is_not_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What is checked is what is loaded: a file swapped in after the check (here one asking for a
    # terabyte) is never given to torch.load.
    from multigpu.checkpoint import torch_file
    from tests.checkpoint import _craft

    path = tmp_path / "w.pt"
    torch.save(filled(1.0).state_dict(), path)
    checked = torch_file.check_torch_file

    def check_then_replace(*args: object, **kwargs: object) -> None:
        checked(*args, **kwargs)  # type: ignore[arg-type]
        bomb = tmp_path / "bomb.pt"
        bomb.write_bytes(_craft.doctored_torch({}, _craft.with_pickle(_craft.BYTEARRAY_BOMB)))
        os.replace(bomb, path)

    monkeypatch.setattr(torch_file, "check_torch_file", check_then_replace)
    model = nn.Linear(3, 2)
    ckpt.load(model, path)
    assert bool((model.weight == 1.0).all())
