from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu
import multigpu.checkpoint as ckpt
from multigpu.checkpoint.formats import detect_format, read_tensors
from multigpu.errors import CheckpointError, ConfigError


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), key


@pytest.mark.parametrize("name", ["w.safetensors", "w.pt", "w"])
def test_round_trip_from_a_wrapper_into_a_bare_model(tmp_path: Path, name: str) -> None:
    source = _net()
    path = ckpt.save(multigpu.DataParallel(source, devices="cpu:2"), tmp_path / name)
    assert detect_format(path) == ("torch" if name.endswith(".pt") else "safetensors")
    assert sorted(read_tensors(path)[0]) == sorted(source.state_dict())  # bare keys
    target = _net()
    ckpt.load(target, path)
    _assert_same(target, source)


def test_torch_format_loads_with_plain_torch(tmp_path: Path) -> None:
    source = _net()
    ckpt.save(nn.DataParallel(source), tmp_path / "w.pt")
    plain = _net()
    plain.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))
    _assert_same(plain, source)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_prefixed_files_load_into_bare_and_wrapped_models(tmp_path: Path, prefix: str) -> None:
    source = _net()
    torch.save({prefix + k: v for k, v in source.state_dict().items()}, tmp_path / "w.pt")
    bare, wrapped = _net(), nn.DataParallel(_net())
    ckpt.load(bare, tmp_path / "w.pt")
    ckpt.load(wrapped, tmp_path / "w.pt")
    _assert_same(bare, source)
    _assert_same(wrapped.module, source)


def test_state_dict_nested_in_a_training_checkpoint_loads(tmp_path: Path) -> None:
    source = _net()
    torch.save({"epoch": 3, "state_dict": source.state_dict()}, tmp_path / "train.ckpt")
    target = _net()
    ckpt.load(target, tmp_path / "train.ckpt")
    _assert_same(target, source)


def test_tied_weights_survive_safetensors(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight

    source = Tied()
    ckpt.save(source, tmp_path / "tied.safetensors")
    target = Tied()
    ckpt.load(target, tmp_path / "tied.safetensors")
    assert torch.equal(target.head.weight, source.embed.weight)
    assert target.head.weight is target.embed.weight


def test_missing_unexpected_and_shape_keys_are_listed(tmp_path: Path) -> None:
    ckpt.save(nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(3, 1)), tmp_path / "w.safetensors")
    other = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))
    with pytest.raises(CheckpointError) as info:
        ckpt.load(other, tmp_path / "w.safetensors")
    message = str(info.value)
    assert "2 unexpected: 2.bias, 2.weight" in message
    assert "2 shape differs: 1.weight: file (3, 8) vs model (4, 8), 1.bias: file (3,) vs model (4,)" in message
    assert "Likely cause: a different version of the model" in message


def test_same_architecture_other_sizes_is_named(tmp_path: Path) -> None:
    ckpt.save(nn.Linear(6, 3), tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match=r"shape differs: weight.*Likely cause: the same architecture"):
        ckpt.load(nn.Linear(6, 4), tmp_path / "w.safetensors")


def test_unknown_prefix_is_named_with_the_fix(tmp_path: Path) -> None:
    source = _net()
    ckpt.save({"model." + k: v for k, v in source.state_dict().items()}, tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match=r"missing: 0\.weight.*prefix 'model\.'.*strip=\('model\.',\)"):
        ckpt.load(_net(), tmp_path / "w.safetensors")
    target = _net()
    ckpt.load(target, tmp_path / "w.safetensors", strip=("model.",))
    _assert_same(target, source)


def test_a_different_model_is_named(tmp_path: Path) -> None:
    ckpt.save(nn.Conv2d(3, 4, 3), tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match=r"Likely cause: a different model: only 0 of the model's"):
        ckpt.load(nn.GRU(3, 4), tmp_path / "w.safetensors")


def test_strict_false_loads_what_matches(tmp_path: Path) -> None:
    source = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    ckpt.save(source, tmp_path / "w.safetensors")
    target = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))
    ckpt.load(target, tmp_path / "w.safetensors", strict=False)
    assert torch.equal(target[0].weight, source[0].weight)


class _Payload:
    """Unpickling this runs code: it creates the file named in its state."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.marker),))


def test_files_that_run_code_are_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    torch.save({"weight": torch.ones(2), "payload": _Payload(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(
        CheckpointError,
        match=r"refusing to load .*evil\.pt.*needs arbitrary unpickling.*pathlib.*"
        r"allow_unsafe_pickle=True",
    ):
        ckpt.load(nn.Linear(2, 1), tmp_path / "evil.pt")
    assert not marker.exists()
    # The explicit opt-in loads it (and runs its code, which is what the user accepted).
    with pytest.raises(CheckpointError, match=r"holds no flat mapping of tensors"):
        ckpt.load(nn.Linear(2, 1), tmp_path / "evil.pt", allow_unsafe_pickle=True)
    assert marker.exists()


def test_unknown_format_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"format='onnx' is not one of \('safetensors', 'torch'\)"):
        ckpt.save(nn.Linear(2, 1), tmp_path / "w", format="onnx")  # type: ignore[arg-type]


def test_a_file_of_another_kind_is_named(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello world")
    with pytest.raises(CheckpointError, match=r"neither a safetensors nor a torch file"):
        ckpt.load(nn.Linear(2, 1), tmp_path / "notes.txt")


def test_keys_helpers_keep_their_api() -> None:
    assert ckpt.WRAPPER_PREFIXES == ("module.", "_orig_mod.")
    assert ckpt.strip_prefixes("module._orig_mod.fc.weight") == "fc.weight"
    assert list(ckpt.clean_state_dict(OrderedDict([("module.a", 1)]))) == ["a"]
    assert ckpt.find_prefixes(["module.a", "module._orig_mod.b", "c"]) == {"module.": 1, "module._orig_mod.": 1}
    inner = nn.Linear(2, 2)
    assert ckpt.unwrap(nn.DataParallel(nn.DataParallel(inner))) is inner


def test_a_suffix_that_contradicts_the_format_is_refused_at_save(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"format='torch' does not match the name .*w\.safetensors.*'w\.pt'"):
        ckpt.save(nn.Linear(2, 1), tmp_path / "w.safetensors", format="torch")
    with pytest.raises(ConfigError, match=r"format='safetensors' does not match .*w\.pt.*'w\.safetensors'"):
        ckpt.save(nn.Linear(2, 1), tmp_path / "w.pt", format="safetensors")
    assert not list(tmp_path.iterdir())


def test_the_format_is_read_from_the_bytes_not_the_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from multigpu.cli.main import main

    source = _net()
    torch.save(source.state_dict(), tmp_path / "renamed.safetensors")  # torch bytes, safetensors name
    target = _net()
    ckpt.load(target, tmp_path / "renamed.safetensors")
    _assert_same(target, source)
    assert main(["ckpt", "inspect", str(tmp_path / "renamed.safetensors")]) == 0
    assert "torch" in capsys.readouterr().out
    assert main(["ckpt", "convert", str(tmp_path / "renamed.safetensors"), str(tmp_path / "clean.safetensors")]) == 0
    ckpt.load(target, tmp_path / "clean.safetensors")
    _assert_same(target, source)


def test_convert_into_a_contradicting_name_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from multigpu.cli.main import main

    ckpt.save(_net(), tmp_path / "w.safetensors")
    assert (
        main(["ckpt", "convert", str(tmp_path / "w.safetensors"), str(tmp_path / "x.safetensors"), "--to", "torch"])
        == 1
    )
    err = capsys.readouterr().err
    assert "does not match the name" in err and len(err.strip().splitlines()) == 1


def test_a_step_folder_without_fsdp_loads_like_a_sharded_one(tmp_path: Path) -> None:
    # multigpu.load took a sharded step folder but refused a one-file one ("Is a directory").
    source = nn.Linear(4, 3)
    saved = ckpt.Checkpointer(folder=tmp_path).save(step=5, model=source)
    loaded = multigpu.load(nn.Linear(4, 3), saved)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in source.state_dict().items())
