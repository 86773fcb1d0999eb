"""Crafted content in the files a run keeps in its checkpoint folder, beyond the weights (issue 29).

The manifest of a sharded step, DCP's index, ``state.pt``, the step a weights header records and
the temporary names of a save: truncated, absurd numbers (1e999, 5000 digits), deep nesting, a list
where a mapping belongs, non-UTF-8. Every reader ends in a CheckpointError naming the file, within
seconds, or ignores what is not its own; none raises a raw ValueError or loads uninitialised memory.
"""

from __future__ import annotations

import copy
import json
import pickle
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.cli.main import main
from multigpu.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP alone, as meant


@pytest.fixture
def quick() -> Iterator[None]:
    start = time.monotonic()
    yield
    assert time.monotonic() - start < 30, "a hostile file must be refused in bounded time"


def _dcp_folder(folder: Path) -> Path:
    """A DCP checkpoint of a Linear(2, 1) under ``model.``, written by torch alone in one process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": nn.Linear(2, 1).state_dict()}, checkpoint_id=str(folder), no_dist=True)
    return folder


GOOD_MANIFEST = {"format": "dcp", "version": 1, "step": 1, "world_size": 1, "files": {}}
_TEXT = json.dumps(GOOD_MANIFEST)

MANIFESTS: dict[str, bytes] = {
    "truncated": _TEXT.encode()[:30],
    "step 1e999": _TEXT.replace('"step": 1', '"step": 1e999').encode(),
    "step of 5000 digits": _TEXT.replace('"step": 1', '"step": ' + "9" * 5000).encode(),
    "a size of 5000 digits": _TEXT.replace(
        '"files": {}', '"files": {".metadata": {"bytes": ' + "9" * 5000 + "}}"
    ).encode(),
    "deep nesting": b'{"files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a list": b"[1, 2]",
    "files a list": json.dumps({**GOOD_MANIFEST, "files": [1]}).encode(),
    "not UTF-8": b'{"format": "\xff\xfe"}',
    "UTF-16": _TEXT.encode("utf-16"),
}


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_a_crafted_manifest_is_refused_by_every_reader(tmp_path: Path, case: str, quick: None) -> None:
    run = tmp_path / "run"
    folder = _dcp_folder(run / "step-00000001")
    (folder / "manifest.json").write_bytes(MANIFESTS[case])
    torch.save({"step": 1}, folder / "state.pt")
    with pytest.raises(CheckpointError, match=r"manifest\.json"):
        ckpt.load(nn.Linear(2, 1), folder)
    assert main(["ckpt", "inspect", str(folder)]) == 1
    assert main(["ckpt", "convert", str(run), str(tmp_path / "out.safetensors")]) == 1
    checkpointer = ckpt.Checkpointer(folder=run, keep_last=1)
    with pytest.raises(CheckpointError, match=r"cannot save step 1: .*step-00000001' exists and is a checkpoint no"):
        checkpointer.save(step=1, model=nn.Linear(2, 1))  # it does not record step 1: not ours to replace
    checkpointer.save(step=2, model=nn.Linear(2, 1))  # nor to prune
    assert (folder / "manifest.json").read_bytes() == MANIFESTS[case]


def _index(folder: Path) -> Any:
    return pickle.loads((folder / ".metadata").read_bytes())  # test's own file: plain pickle is fine here


def _set(entry: str, name: str, value: Any) -> Callable[[Any], None]:
    return lambda md: setattr(md.state_dict_metadata[entry], name, value)


INDEXES: dict[str, tuple[Callable[[Any], None], str]] = {
    "storage_meta an int": (lambda md: setattr(md, "storage_meta", 5), r"'storage_meta' is 'int'; expected None or"),
    "a tensor without slices": (
        _set("model.weight", "chunks", []),
        r"the slices of 'model\.weight' is '0 slices of 0 elements'; expected slices covering its 2 elements",
    ),
    "a shape of 2**60 elements with one small slice": (
        _set("model.weight", "size", torch.Size([1 << 40, 1 << 20])),
        r"the slices of 'model\.weight' is '1 slices of 2 elements'; expected slices covering its 1152921504606846976",
    ),
}


@pytest.mark.parametrize("case", sorted(INDEXES))
def test_a_crafted_dcp_index_is_refused_before_anything_is_read(tmp_path: Path, case: str, quick: None) -> None:
    change, message = INDEXES[case]
    folder = _dcp_folder(tmp_path / "step-00000001")
    index = copy.deepcopy(_index(folder))
    change(index)
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    model = nn.Linear(2, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"\.metadata': " + message):
        ckpt.load(model, folder)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert main(["ckpt", "inspect", str(folder)]) == 1


def test_tensors_beyond_this_machines_memory_are_a_checkpoint_error(tmp_path: Path, quick: None) -> None:
    folder = _dcp_folder(tmp_path / "w")
    index = _index(folder)
    entry = index.state_dict_metadata["model.weight"]
    huge = torch.Size([1 << 40, 1 << 20])  # 4 EiB of float32, one slice declaring all of it
    entry.size, entry.chunks[0].sizes = huge, huge
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(CheckpointError, match=r"tensors of '.*w' do not fit in memory here .* declares \d+ bytes"):
        ckpt.load(nn.Linear(2, 1), folder)
    assert main(["ckpt", "convert", str(folder), str(tmp_path / "o.safetensors")]) == 1  # --max-expansion


def test_a_state_file_with_an_int_of_thousands_of_digits_is_damaged_not_unsafe(tmp_path: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    folder = checkpointer.save(step=1, model=nn.Linear(2, 1))
    state = torch.load(folder / "state.pt", weights_only=True)
    torch.save({**state, "step": 2**20000}, folder / "state.pt")
    with pytest.raises(
        CheckpointError, match=r"state\.pt' is a damaged torch file: .*weights-only reader does not read"
    ):
        checkpointer.resume(model=nn.Linear(2, 1))


def test_a_weights_header_recording_a_step_of_5000_digits_is_not_ours(tmp_path: Path, quick: None) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path, keep_last=1)
    folder = checkpointer.save(step=1, model=nn.Linear(2, 1))
    weights = dict(nn.Linear(2, 1).state_dict())
    safetensors.torch.save_file(weights, str(folder / "model.safetensors"), {"step": "1" * 5000})
    with pytest.raises(CheckpointError, match=r"cannot save step 1: .* a checkpoint no Checkpointer wrote"):
        checkpointer.save(step=1, model=nn.Linear(2, 1))
    checkpointer.save(step=2, model=nn.Linear(2, 1))  # prunes only what records its step
    assert folder.is_dir()


def test_a_temporary_name_with_a_pid_of_20_digits_is_left_alone(tmp_path: Path) -> None:
    host = socket.gethostname().replace(".", "_")
    stray = tmp_path / f".w.safetensors.tmp-{host}-99999999999999999999-abcd1234"
    stray.write_bytes(b"x")
    ckpt.save(nn.Linear(2, 1), tmp_path / "w.safetensors")  # os.kill(pid, 0) would overflow
    assert stray.exists()
