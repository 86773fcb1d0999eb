"""``manifest.json``, the one checksum scheme of both storages' step folders (the one-file storage's here).

The oracle for a CRC-32 is zlib's of the whole file; damage is done to real files a Checkpointer wrote.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.checkpoint.manifest import PIECE, combine, file_record
from multigpu.checkpoint.safetensors_file import read_header
from multigpu.cli.main import main
from multigpu.errors import CheckpointError


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=6))
def test_combine_gives_zlibs_crc_of_the_pieces_joined(pieces: list[bytes]) -> None:
    assert combine((zlib.crc32(p), len(p)) for p in pieces) == zlib.crc32(b"".join(pieces))


def test_a_files_record_is_its_size_and_zlibs_crc(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(2 * PIECE + 12345))  # three pieces, the last a short one
    record = file_record(path)
    assert (record.nbytes, record.crc32) == (2 * PIECE + 12345, zlib.crc32(path.read_bytes()))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(1100, 1000)  # 4.4 MB of weights: more than one CRC piece
        self.tail = nn.Linear(3, 3)
        self.again = self.tail  # tied: written once, an alias in the header
        self.register_buffer("empty", torch.zeros(0))


def test_a_one_file_step_lists_its_weights_in_its_manifest_and_state_names_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Tied()
    folder = ckpt.Checkpointer(folder=tmp_path).save(step=7, model=model)
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "model.safetensors", "state.pt"]
    body = json.loads((folder / "manifest.json").read_text())
    weights = (folder / "model.safetensors").read_bytes()
    assert body == {
        "format": "safetensors",
        "version": 1,
        "step": 7,
        "world_size": 1,
        "files": {"model.safetensors": {"bytes": len(weights), "crc32": f"{zlib.crc32(weights):08x}"}},
    }  # the CRC-32 taken from the tensors in memory is the file's
    metadata = read_header(folder / "model.safetensors").metadata
    assert "multigpu.checksum" not in metadata and "multigpu.aliases" in metadata  # one scheme: the manifest
    assert torch.load(folder / "state.pt", weights_only=True)["model_checksum"].startswith("safetensors:crc32:")
    fresh = _Tied()
    ckpt.Checkpointer(folder=tmp_path).resume(model=fresh)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


def _flip_tensor_byte(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def _rename_a_key(folder: Path) -> None:  # a header still valid: only a checksum tells
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"weight"', b'"weighu"', 1))


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4])


def _edit_manifest(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        body = json.loads((folder / "manifest.json").read_text())
        change(body)
        (folder / "manifest.json").write_text(json.dumps(body))

    return edit


DAMAGE: dict[str, tuple[Callable[[Path], object], str, bool]] = {
    # damage, what resume and load say, whether inspect (sizes only, no data read) refuses it too
    "flipped tensor byte": (_flip_tensor_byte, r"model\.safetensors' does not match the CRC-32 its manifest", False),
    "renamed key": (_rename_a_key, r"model\.safetensors' does not match the CRC-32 its manifest", False),
    "truncated weights": (_truncate, r"model\.safetensors' has \d+ bytes; the manifest records \d+", True),
    "manifest missing": (lambda f: (f / "manifest.json").unlink(), r"manifest\.json' is missing: nothing", True),
    "manifest not JSON": (lambda f: (f / "manifest.json").write_text("{"), r"manifest\.json' is not valid JSON", True),
    "manifest of the other storage": (
        _edit_manifest(lambda b: b.update(format="dcp")),
        r"manifest\.json': 'format'/'version' is \('dcp', 1\); expected \('safetensors', 1\)",
        True,
    ),
    "a listed file missing": (
        _edit_manifest(lambda b: b["files"].update({"extra.bin": {"bytes": 1, "crc32": "00000000"}})),
        r"extra\.bin', a file of the checkpoint, is missing",
        True,
    ),
    "weights not listed": (
        _edit_manifest(lambda b: b.update(files={})),
        r"manifest\.json': 'files' is \{\}; expected an object naming every file of the storage",
        True,
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damage_to_a_one_file_step_is_refused_by_every_reader(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    harm, message, inspect_refuses = DAMAGE[damage]
    folder = ckpt.Checkpointer(folder=tmp_path).save(step=1, model=nn.Linear(4, 3))
    harm(folder)
    model = nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message):
        ckpt.Checkpointer(folder=tmp_path).resume(model=model)
    with pytest.raises(CheckpointError, match=message):
        ckpt.load(model, folder)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert main(["ckpt", "convert", str(folder), str(tmp_path / "out.safetensors")]) == 1
    assert main(["ckpt", "inspect", str(folder)]) == (1 if inspect_refuses else 0)
    capsys.readouterr()


def _pipe_as_weights(folder: Path, *, listed: bool) -> None:
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    if listed:  # a manifest that records the pipe's size: only opening it would tell
        _edit_manifest(lambda b: b["files"]["model.safetensors"].update(bytes=0))(folder)
    else:
        (folder / "manifest.json").unlink()  # as in a folder written before manifests


@pytest.mark.timeout(60)
@pytest.mark.parametrize("listed", [True, False], ids=["listed-in-the-manifest", "no-manifest"])
def test_a_pipe_as_a_one_file_steps_weights_is_named_at_once(
    tmp_path: Path, listed: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = ckpt.Checkpointer(folder=tmp_path).save(step=1, model=nn.Linear(4, 3))
    _pipe_as_weights(folder, listed=listed)
    named = r"model\.safetensors'?: it is a named pipe \(FIFO\)"
    with pytest.raises(CheckpointError, match=named):
        ckpt.Checkpointer(folder=tmp_path).resume(model=nn.Linear(4, 3), path=folder)
    with pytest.raises(CheckpointError, match=named):
        ckpt.load(nn.Linear(4, 3), folder)
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(folder)]) == 1
    assert "named pipe" in capsys.readouterr().err


def test_a_step_folders_weights_loaded_alone_are_checked_against_its_manifest(tmp_path: Path) -> None:
    folder = ckpt.Checkpointer(folder=tmp_path).save(step=1, model=nn.Linear(4, 3))
    loaded = ckpt.load(nn.Linear(4, 3), folder / "model.safetensors")  # intact: loads
    _flip_tensor_byte(folder)
    before = {k: v.clone() for k, v in loaded.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"model\.safetensors' does not match the CRC-32 its manifest records"):
        ckpt.load(loaded, folder / "model.safetensors")
    assert all(torch.equal(v, before[k]) for k, v in loaded.state_dict().items())


def test_another_tools_manifest_beside_a_weights_file_is_left_alone(tmp_path: Path) -> None:
    source = nn.Linear(4, 3)
    path = ckpt.save(source, tmp_path / "model.safetensors")
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "my-model", "files": ["model.safetensors"]}))
    loaded = ckpt.load(nn.Linear(4, 3), path)
    assert torch.equal(loaded.weight, source.weight)
