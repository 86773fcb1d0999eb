"""Which format a file is comes from its structure, so every file multigpu writes reads back (issue 29).

A safetensors file starts with its header's length: a header of 128 + 256k bytes makes the first
byte 0x80, a pickle's first byte, and one of 0x4B50 bytes makes it start with "PK", a zip's. These
files must read back through every reader (``multigpu.load``, ``Checkpointer.resume``,
``multigpu ckpt inspect`` and ``convert``), whatever the header length modulo 256.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.checkpoint.formats import detect_format
from multigpu.cli.main import main
from multigpu.errors import CheckpointError
from tests.checkpoint import _craft

# Names that grow the header by 8 bytes from one to the next: safetensors pads its header to a
# multiple of 8, so these reach every residue a written header can have modulo 256 (32 of them).
GROWTH = list(range(0, 256, 8))


class _One(nn.Module):
    """A model of one parameter whose name has ``extra`` more characters than ``w``."""

    def __init__(self, extra: int, value: float = 0.0) -> None:
        super().__init__()
        self.register_parameter("w" + "x" * extra, nn.Parameter(torch.full((3,), value)))


def _header_length(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_the_sweep_reaches_every_header_residue_and_the_bytes_that_fooled_the_detection(tmp_path: Path) -> None:
    plain, stepped = set(), set()
    for extra in GROWTH:
        plain.add(_header_length(ckpt.save(_One(extra), tmp_path / "m.safetensors")) % 256)
        folder = ckpt.Checkpointer(folder=tmp_path / "run", keep_last=1).save(step=1, model=_One(extra))
        stepped.add(_header_length(folder / "model.safetensors") % 256)
    every = set(range(0, 256, 8))
    assert plain == every and stepped == every  # 128 among them: the first byte is 0x80


@pytest.mark.parametrize("extra", GROWTH)
def test_a_saved_file_of_every_header_residue_reads_back_through_every_reader(
    tmp_path: Path, extra: int, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _One(extra, 1.5)
    path = ckpt.save(source, tmp_path / "m.safetensors")
    assert detect_format(path) == "safetensors"
    target = _One(extra)
    ckpt.load(target, path)
    assert _same(target, source)

    assert main(["ckpt", "inspect", str(path)]) == 0
    assert "safetensors" in capsys.readouterr().out
    for out in (tmp_path / "c.pt", tmp_path / "c.safetensors"):
        assert main(["ckpt", "convert", str(path), str(out)]) == 0
        again = _One(extra)
        ckpt.load(again, out)
        assert _same(again, source)

    checkpointer = ckpt.Checkpointer(folder=tmp_path / "run")
    folder = checkpointer.save(step=3, model=source, optimizer=torch.optim.SGD(source.parameters(), lr=0.1))
    resumed_model = _One(extra)
    resumed = checkpointer.resume(model=resumed_model, optimizer=torch.optim.SGD(resumed_model.parameters(), lr=0.1))
    assert resumed is not None and resumed.step == 3 and _same(resumed_model, source)
    assert main(["ckpt", "inspect", str(folder)]) == 0
    assert main(["ckpt", "convert", str(tmp_path / "run"), str(tmp_path / "from-run.safetensors")]) == 0


def _crafted_safetensors(length: int) -> bytes:
    """A valid safetensors file (no checksum) of one float32 tensor 'w' whose header is ``length`` bytes."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}).encode()
    assert len(header) <= length
    return struct.pack("<Q", length) + header.ljust(length) + struct.pack("<3f", 1.0, 2.0, 3.0)


@pytest.mark.parametrize("length", [*range(256, 512), 0x4B50, 0x4B50 + 0x10000, 0x8050])
def test_a_header_of_any_length_is_safetensors(tmp_path: Path, length: int) -> None:
    # Other writers need not pad to 8: every residue modulo 256, and lengths whose bytes read
    # 0x80 (a pickle) or "PK" (a zip).
    path = tmp_path / "w.safetensors"
    path.write_bytes(_crafted_safetensors(length))
    assert detect_format(path) == "safetensors"
    model = _One(0)
    ckpt.load(model, path)
    assert model.w.tolist() == [1.0, 2.0, 3.0]


def _legacy(obj: object, protocol: int) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    return buffer.getvalue()


WRITERS = {
    "multigpu safetensors": lambda sd, path: ckpt.save(sd, path.with_suffix(".safetensors")),
    "safetensors library": lambda sd, path: safetensors.torch.save_file(sd, str(path.with_suffix(".safetensors"))),
    "multigpu torch": lambda sd, path: ckpt.save(sd, path.with_suffix(".pt")),
    "torch.save": lambda sd, path: torch.save(sd, path.with_suffix(".pt")),
    "torch.save nested": lambda sd, path: torch.save({"state_dict": sd}, path.with_suffix(".pt")),
    "legacy torch, protocol 2": lambda sd, path: path.with_suffix(".pt").write_bytes(_legacy(sd, 2)),
    "legacy torch, protocol 4": lambda sd, path: path.with_suffix(".pt").write_bytes(_legacy(sd, 4)),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("extra", [0, 248])  # 248: multigpu.save writes a header of 128 + 256k bytes
def test_every_format_reads_through_every_reader(tmp_path: Path, writer: str, extra: int) -> None:
    source = _One(extra, 2.5)
    WRITERS[writer](dict(source.state_dict()), tmp_path / "w")
    (path,) = [p for p in tmp_path.iterdir() if p.name.startswith("w.")]
    if writer == "multigpu safetensors" and extra == 248:
        assert path.read_bytes()[:1] == b"\x80"
    legacy = writer.startswith("legacy")
    unsafe = ["--allow-unsafe-pickle"] if legacy else []
    assert detect_format(path) == ("safetensors" if path.suffix == ".safetensors" else "torch")
    target = _One(extra)
    ckpt.load(target, path, allow_unsafe_pickle=legacy)
    assert _same(target, source)
    assert main(["ckpt", "inspect", str(path), *unsafe]) == 0
    assert main(["ckpt", "convert", str(path), str(tmp_path / "out.safetensors"), *unsafe]) == 0
    again = _One(extra)
    ckpt.load(again, tmp_path / "out.safetensors")
    assert _same(again, source)


def test_the_issue_repro_loads_back(tmp_path: Path) -> None:
    source = nn.Sequential(*[nn.Linear(4, 4) for _ in range(64)])
    path = ckpt.save(source, tmp_path / "m.safetensors")
    assert path.read_bytes()[:1] == b"\x80"  # the case that was taken for a pickle
    target = nn.Sequential(*[nn.Linear(4, 4) for _ in range(64)])
    ckpt.load(target, path)
    assert _same(target, source)


# --- what is not a format: named by what it is --------------------------------------------------


def test_a_legacy_torch_file_is_refused_as_legacy_without_the_opt_in(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    path.write_bytes(_legacy({"w": torch.zeros(3)}, 4))
    with pytest.raises(CheckpointError, match=r"old\.pt.*legacy \(pre-1\.6\).*allow_unsafe_pickle=True"):
        ckpt.load(_One(0), path)


def test_a_plain_pickle_is_neither_format(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    path.write_bytes(pickle.dumps({"w": [1.0, 2.0, 3.0]}, protocol=2))  # starts with 0x80, not torch's magic
    with pytest.raises(CheckpointError, match=r"w\.pt' is neither a safetensors nor a torch file"):
        ckpt.load(_One(0), path)
    assert main(["ckpt", "inspect", str(path)]) == 1


def test_a_truncated_safetensors_file_whose_length_starts_with_0x80_names_the_header(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(_crafted_safetensors(128)[:100])
    with pytest.raises(CheckpointError, match=r"header claims 128 bytes but only 92 follow \(truncated\?\)"):
        ckpt.load(_One(0), path)


def test_a_zip_with_data_before_it_is_named(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    path.write_bytes(b"junk" * 4 + _craft.doctored_torch({"w": torch.zeros(3)}, lambda root, r: r))
    with pytest.raises(CheckpointError, match=r"w\.pt.*does not start at byte 0 \(data was prepended"):
        ckpt.load(_One(0), path)


def test_a_state_file_that_is_a_safetensors_file_is_named_so(tmp_path: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    folder = checkpointer.save(step=1, model=_One(0))
    (folder / "state.pt").write_bytes(_crafted_safetensors(128))
    with pytest.raises(CheckpointError, match=r"state\.pt' is not a valid torch checkpoint: it is a safetensors file"):
        checkpointer.resume(model=_One(0))
