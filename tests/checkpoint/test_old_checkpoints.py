"""Checkpoints written by earlier versions keep loading: a one-file step folder saved by main at 63f0a3b.

``fixtures/one-file-63f0a3b`` was written by that revision's ``Checkpointer.save`` (the weights'
checksum in the safetensors header, repeated in ``state.pt``) from the run :func:`_run` repeats here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

import multigpu
import multigpu.checkpoint as ckpt
from multigpu.checkpoint.weights import summarize

FIXTURE = Path(__file__).parent / "fixtures" / "one-file-63f0a3b"


def _run() -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def test_a_one_file_checkpoint_of_63f0a3b_resumes_whole(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "run")
    saved, saved_opt = _run()
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    resumed = ckpt.Checkpointer(folder=tmp_path / "run").resume(model=model, optimizer=opt)
    assert resumed is not None and (resumed.step, resumed.epoch, resumed.data_position) == (5, 1, {"batch": 2})
    for key, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt.state_dict()["state"][0]["exp_avg"])


def test_a_one_file_checkpoint_of_63f0a3b_is_inspected_loaded_and_pruned(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "run")
    step = tmp_path / "run" / "step-00000005"
    summary = summarize(step)
    assert (summary.format, summary.step, sorted(t.key for t in summary.tensors)) == (
        "safetensors",
        5,
        ["bias", "weight"],
    )
    saved, _ = _run()
    loaded = nn.Linear(3, 2)
    multigpu.load(loaded, step)
    assert torch.equal(loaded.weight, saved.weight)
    saver = ckpt.Checkpointer(folder=tmp_path / "run", keep_last=1)
    saver.save(step=6, model=loaded)
    assert saver.steps() == [6]  # the old step is recognised as one a Checkpointer wrote, so it is pruned
