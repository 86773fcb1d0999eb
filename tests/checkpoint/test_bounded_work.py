"""Hostile files cost bounded work: inspect reads headers only, convert refuses tensors that would blow up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.cli.main import main
from tests.checkpoint import _craft


@pytest.mark.timeout(60)
def test_inspect_of_a_stride_0_tensor_reads_no_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _craft.expanded_tensor_file(tmp_path / "huge.pt")  # 4 bytes of storage, a 4 TiB view
    assert main(["ckpt", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "weight" in out and "[1099511627776]" in out and "4096.0 GiB" in out


@pytest.mark.timeout(60)
def test_convert_refuses_a_tensor_far_larger_than_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _craft.expanded_tensor_file(tmp_path / "huge.pt")
    out = tmp_path / "out.safetensors"
    assert main(["ckpt", "convert", str(path), str(out)]) == 1
    err = capsys.readouterr().err
    assert "huge.pt" in err and "above the limit of 4x" in err and "'weight'" in err and "--max-expansion" in err
    assert not out.exists()


def test_convert_allows_a_modest_expansion_when_told(tmp_path: Path) -> None:
    path = _craft.expanded_tensor_file(tmp_path / "wide.pt", numel=1 << 20)  # 4 MiB once contiguous
    out = tmp_path / "out.safetensors"
    assert main(["ckpt", "convert", str(path), str(out)]) == 1
    assert main(["ckpt", "convert", str(path), str(out), "--max-expansion", "inf"]) == 0
    assert torch.equal(ckpt.formats.read_tensors(out)[0]["weight"], torch.zeros(1 << 20))


@pytest.mark.parametrize("value", ["0.5", "nan", "-1", "lots"])
def test_max_expansion_must_be_a_factor(tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["ckpt", "convert", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--max-expansion", value])
    assert "is not a number >= 1 (or 'inf')" in capsys.readouterr().err


def test_loading_a_stride_0_file_into_a_model_needs_no_more_than_the_model(tmp_path: Path) -> None:
    path = _craft.expanded_tensor_file(tmp_path / "bias.pt", numel=1 << 16)
    model = nn.Module()
    model.weight = nn.Parameter(torch.ones(1 << 16))
    ckpt.load(model, path)  # copied into the parameter that already exists: no new allocation
    assert bool((model.weight == 0).all())


@pytest.mark.timeout(60)
def test_inspect_of_a_state_whose_data_position_shares_itself_2_to_the_30_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    folder = checkpointer.save(step=1, model=nn.Linear(2, 2))
    state = torch.load(folder / "state.pt", weights_only=True)
    state["data_position"] = {"order": _craft.billion_laughs_state(30)}  # printed naively: 2**30 items
    torch.save(state, folder / "state.pt")
    assert main(["ckpt", "inspect", str(tmp_path)]) == 0
    assert "order" in capsys.readouterr().out
    resumed = checkpointer.resume(model=nn.Linear(2, 2))  # the walk visits each shared list once
    assert resumed is not None and resumed.step == 1
