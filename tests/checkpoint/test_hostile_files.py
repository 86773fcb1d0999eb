"""Malformed and crafted files: every reader refuses them with CheckpointError (CLI: one line, exit 1).

No raw SafetensorError/RuntimeError, no traceback, no allocation the file's size does not
justify, and the model is untouched.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.cli.main import main
from multigpu.errors import CheckpointError
from tests.checkpoint import _craft

CASES = sorted(_craft.MALFORMED_WEIGHTS)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("case", CASES)
def test_load_refuses_with_a_typed_error_naming_the_file(tmp_path: Path, case: str) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(_craft.MALFORMED_WEIGHTS[case]())
    model = nn.Linear(2, 1)
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=r"w\.safetensors"):
        ckpt.load(model, path)
    _assert_untouched(model, before)


@pytest.mark.parametrize("case", CASES)
def test_resume_refuses_a_malformed_weights_file(tmp_path: Path, case: str) -> None:
    model = nn.Linear(2, 1)
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    folder = checkpointer.save(step=1, model=model)
    (folder / "model.safetensors").write_bytes(_craft.MALFORMED_WEIGHTS[case]())
    fresh = nn.Linear(2, 1)
    before = _snapshot(fresh)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        checkpointer.resume(model=fresh)
    _assert_untouched(fresh, before)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("action", ["inspect", "convert"])
def test_cli_prints_one_line_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, action: str
) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(_craft.MALFORMED_WEIGHTS[case]())
    args = [str(path)] if action == "inspect" else [str(path), str(tmp_path / "out.safetensors")]
    assert main(["ckpt", action, *args]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "w.safetensors" in err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.safetensors").exists()


def test_a_state_file_asking_for_a_huge_bytearray_is_refused_before_unpickling(tmp_path: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    folder = checkpointer.save(step=1, model=nn.Linear(2, 1))
    (folder / "state.pt").write_bytes(_craft.doctored_torch({"step": 1}, _craft.with_pickle(_craft.BYTEARRAY_BOMB)))
    with pytest.raises(CheckpointError, match=r"state\.pt.*needs arbitrary unpickling \(builtins\.bytearray\)"):
        checkpointer.resume(model=nn.Linear(2, 1))


def test_a_torch_file_of_sparse_tensors_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"weight": torch.eye(2).to_sparse(), "bias": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match=r"w\.pt.*needs arbitrary unpickling"):
        ckpt.load(nn.Linear(2, 2), path)


def test_a_tensor_under_a_non_string_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({0: torch.zeros(2), 1: torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match=r"w\.pt.*under the key 0; keys must be strings"):
        ckpt.load(nn.Linear(2, 1), path)


def test_damaged_alias_metadata_is_refused(tmp_path: Path) -> None:
    header = {"__metadata__": {"multigpu.aliases": '{"b": "missing"}'}, "a": _craft.F32}
    (tmp_path / "w.safetensors").write_bytes(_craft.safetensors_bytes(header, bytes(8)))
    with pytest.raises(CheckpointError, match=r"damaged 'multigpu\.aliases' entry"):
        ckpt.load(nn.Linear(2, 1), tmp_path / "w.safetensors")


def test_header_messages_say_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    expectations = {
        "header too long": r"header length is 200000000 bytes; expected 2 to 100000000",
        "header longer than the file": r"header claims 4096 bytes but only \d+ follow",
        "overlapping offsets": r"tensors 'a' and 'b' overlap",
        "offsets past the file": r"tensor 'a' ends at byte 400 but the data section holds 8",
        "unknown dtype": r"tensor 'a' has dtype 'F4X'; expected one of",
        "negative offsets": r"data_offsets \[-4, 0\]; expected \[begin, end\]",
        "safetensors/zip polyglot": r"both a safetensors file and a zip archive",
        "torch zip without version": r"no 'archive/version' record",
        "torch zip without data.pkl": r"no 'archive/data\.pkl' record",
        "torch zip with a path-traversal member": r"member named '\.\./\.\./etc/evil'",
        "legacy torch pickle renamed": r"legacy \(pre-1\.6\).*allow_unsafe_pickle=True",
    }
    for case, expected in expectations.items():
        path.write_bytes(_craft.MALFORMED_WEIGHTS[case]())
        with pytest.raises(CheckpointError, match=expected):
            ckpt.load(nn.Linear(2, 1), path)


def test_a_legacy_torch_file_loads_when_trusted(tmp_path: Path) -> None:
    source = nn.Linear(2, 1)
    (tmp_path / "old.pt").write_bytes(_craft.legacy_torch_bytes(source.state_dict()))
    target = nn.Linear(2, 1)
    ckpt.load(target, tmp_path / "old.pt", allow_unsafe_pickle=True)
    assert torch.equal(target.weight, source.weight)


def test_length_field_is_read_as_unsigned(tmp_path: Path) -> None:
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<q", -1) + b"{}")
    with pytest.raises(CheckpointError, match=r"header length is 18446744073709551615 bytes"):
        ckpt.load(nn.Linear(2, 1), tmp_path / "w.safetensors")


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["w.safetensors", "w.pt"])
def test_a_flipped_bit_in_a_tensor_is_refused(tmp_path: Path, name: str) -> None:
    source = nn.Linear(64, 64)
    path = ckpt.save(source, tmp_path / name)
    raw = path.read_bytes()
    _flip(path, raw.index(source.weight.detach().numpy().tobytes()[:64]) + 10)  # inside the weight's bytes
    model = nn.Linear(64, 64)
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=r"w\.(safetensors|pt).* is damaged: .*(checksum|CRC-32)"):
        ckpt.load(model, path)
    _assert_untouched(model, before)


def test_a_flipped_bit_in_a_header_is_refused_even_by_inspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = ckpt.save({"layer.weight": torch.ones(2)}, tmp_path / "w.safetensors")
    raw = path.read_bytes()
    _flip(path, raw.index(b"layer.weight"))  # a valid header with another key name: only a checksum tells
    assert main(["ckpt", "inspect", str(path)]) == 1
    assert (
        "its header (tensor names, dtypes, shapes or metadata) does not match the checksum" in capsys.readouterr().err
    )
    # A flipped tensor byte leaves the header intact: inspect (headers only) still describes the file.
    other = ckpt.save({"layer.weight": torch.ones(2)}, tmp_path / "v.safetensors")
    _flip(other, other.stat().st_size - 1)
    assert main(["ckpt", "inspect", str(other)]) == 0


def test_state_of_one_save_with_weights_of_another_is_refused(tmp_path: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    first = checkpointer.save(step=3, model=nn.Linear(2, 2))
    kept = {name: (first / name).read_bytes() for name in ("model.safetensors", "manifest.json")}
    checkpointer.save(step=3, model=nn.Linear(2, 2))  # a re-save of the same step: same step metadata
    (first / "model.safetensors").write_bytes(kept["model.safetensors"])  # of the same size
    model = nn.Linear(2, 2)
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=r"model\.safetensors' does not match the CRC-32 its manifest records"):
        checkpointer.resume(model=model)
    (first / "manifest.json").write_bytes(kept["manifest.json"])  # weights and manifest of the other save
    with pytest.raises(CheckpointError, match=r"model\.safetensors': its checksum is"):
        checkpointer.resume(model=model)
    _assert_untouched(model, before)


def test_deep_nesting_is_refused_without_recursing(tmp_path: Path) -> None:
    # {"model": {"model": ... 1}} 5000 deep, as pickle opcodes (torch.save itself would recurse).
    key = b"X" + struct.pack("<I", 5) + b"model"
    pickle_bytes = b"\x80\x02" + (b"}" + key) * 5000 + b"K\x01" + b"s" * 5000 + b"."
    (tmp_path / "deep.pt").write_bytes(_craft.doctored_torch({}, _craft.with_pickle(pickle_bytes)))
    with pytest.raises(CheckpointError, match=r"deep\.pt.*holds no flat mapping of tensors"):
        ckpt.load(nn.Linear(1, 1), tmp_path / "deep.pt")


def test_a_folder_given_as_a_weights_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"is a folder without model\.safetensors .*give a weights file"):
        ckpt.load(nn.Linear(2, 1), tmp_path)


def test_a_flipped_byte_in_the_checksum_name_does_not_disable_the_check(tmp_path: Path) -> None:
    source = nn.Linear(8, 8)
    path = ckpt.save(source, tmp_path / "w.safetensors")
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"multigpu.checksum")] ^= 0x01  # 'lultigpu.checksum': the file would look checksum-less
    raw[-1] ^= 0x01  # and a tensor byte is damaged too
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"looks like a damaged 'multigpu\.checksum'"):
        ckpt.load(nn.Linear(8, 8), path)


def test_a_crafted_storage_that_agrees_with_its_record_loads_and_inspects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The crafting below is sound: the same file with consistent sizes is an ordinary torch file.
    path = tmp_path / "w.pt"
    path.write_bytes(_craft.torch_with_storage(declared=2, record_bytes=8, shape=(2,)))
    model = nn.Linear(2, 1)
    ckpt.load(model, path, strict=False)
    assert main(["ckpt", "inspect", str(path)]) == 0
    assert "weight" in capsys.readouterr().out


@pytest.mark.parametrize("case", sorted(_craft.CONTRADICTED_STORAGES))
def test_storages_that_contradict_their_records_are_damaged_for_load_and_inspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    # inspect reads no tensor data, but the zip directory and the pickle already tell: it reports
    # the file as damaged with exit 1, as load does.
    path = tmp_path / "w.pt"
    path.write_bytes(_craft.CONTRADICTED_STORAGES[case]())
    model = nn.Linear(2, 1)
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=r"w\.pt' is a damaged torch file"):
        ckpt.load(model, path, strict=False)
    _assert_untouched(model, before)
    assert main(["ckpt", "inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert "w.pt" in err and "damaged torch file" in err and "Traceback" not in err
