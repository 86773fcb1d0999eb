"""Checkpoints ask the rest of the library: ranks from the distributed runtime, generators from the device objects.

The random state of every registered accelerator type goes into a checkpoint and comes back on
resume (checked with a registered fake type, ``meta``, so it runs without a GPU), and the main
process that writes is the one :func:`multigpu.is_main_process` names, launched or not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu
import multigpu.checkpoint as ckpt
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.devices import register_device_type, unregister_device_type
from multigpu.errors import CheckpointError
from tests.devices.fake_device import MetaDevice


def test_every_accelerator_types_generators_are_saved_and_restored(tmp_path: Path, meta: MetaDevice) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    folder = checkpointer.save(step=1, model=nn.Linear(2, 2))
    assert [int(t) for t in load_torch_file(folder / "state.pt")["rng"][0]["meta"]] == [1, 2]
    meta.rng = [torch.tensor([9], dtype=torch.uint8)] * 2
    assert checkpointer.resume(model=nn.Linear(2, 2)) is not None
    assert [int(t) for t in meta.rng] == [1, 2]


def test_a_random_state_of_a_type_nobody_registered_is_refused(tmp_path: Path, meta: MetaDevice) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    checkpointer.save(step=1, model=nn.Linear(2, 2))
    unregister_device_type("meta")
    with pytest.raises(CheckpointError, match=r"entry 'rng'\[0\].*'torch' \(and maybe 'cuda', 'xpu', 'mps'\)"):
        checkpointer.resume(model=nn.Linear(2, 2))
    register_device_type(meta)  # the fixture unregisters it again


def test_a_launched_rank_other_than_0_is_not_the_main_process_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before one rank helper, checkpoints called every process without a process group rank 0."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not multigpu.is_main_process()
    assert ckpt.save(nn.Linear(2, 2), tmp_path / "w.safetensors") == tmp_path / "w.safetensors"
    ckpt.Checkpointer(folder=tmp_path / "run").save(step=1, model=nn.Linear(2, 2))
    assert not (tmp_path / "w.safetensors").exists()
    assert ckpt.find_latest(tmp_path / "run") is None


def test_the_launched_main_process_writes_the_ranks_that_took_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of two, no process group: it saves alone, so the checkpoint holds one random state and says so."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    folder = ckpt.Checkpointer(folder=tmp_path).save(step=1, model=nn.Linear(2, 2))
    state = load_torch_file(folder / "state.pt")
    assert state["world_size"] == 1 and len(state["rng"]) == 1
    with pytest.warns(RuntimeWarning, match=r"resuming at world_size=2 from a checkpoint saved at world_size=1"):
        assert ckpt.Checkpointer(folder=tmp_path).resume(model=nn.Linear(2, 2)) is not None
