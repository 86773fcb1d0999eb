"""Wrapper prefixes are removed only where a wrapper put them; a child named ``module`` round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu
import multigpu.checkpoint as ckpt
from multigpu.checkpoint.formats import read_tensors
from multigpu.cli.main import main
from multigpu.errors import CheckpointError


class ChildNamedModule(nn.Module):
    """A model (not a wrapper) whose child happens to be called ``module``, next to another child."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)


class OnlyChildNamedModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(3, 3)


class ChildNamedModuleAndOwnWeight(nn.Module):
    """Its own ``weight`` next to ``module.weight``: stripping ``module.`` would merge them."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(3, 3, bias=False)
        self.weight = nn.Parameter(torch.randn(3, 3))


MODELS = [ChildNamedModule, OnlyChildNamedModule, ChildNamedModuleAndOwnWeight]


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    assert list(a.state_dict()) == list(b.state_dict())
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), key


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("name", ["w.safetensors", "w.pt"])
def test_a_child_named_module_round_trips_through_save_and_load(tmp_path: Path, cls: type, name: str) -> None:
    torch.manual_seed(0)
    source = cls()
    path = ckpt.save(source, tmp_path / name)
    assert sorted(read_tensors(path)[0]) == sorted(source.state_dict())  # every tensor, its own key
    torch.manual_seed(1)
    target = cls()
    ckpt.load(target, path)
    _assert_same(target, source)


@pytest.mark.parametrize("cls", MODELS)
def test_a_child_named_module_round_trips_through_a_checkpointer(tmp_path: Path, cls: type) -> None:
    torch.manual_seed(0)
    source = cls()
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    checkpointer.save(step=1, model=nn.DataParallel(source))
    torch.manual_seed(1)
    target = cls()
    assert checkpointer.resume(model=target) is not None
    _assert_same(target, source)


@pytest.mark.parametrize("cls", MODELS)
def test_a_wrapped_models_own_state_dict_loads_into_the_bare_model(tmp_path: Path, cls: type) -> None:
    torch.manual_seed(0)
    source = cls()
    torch.save(nn.DataParallel(source).state_dict(), tmp_path / "dp.pt")  # module.module.weight, module.weight, ...
    torch.manual_seed(1)
    target = cls()
    ckpt.load(target, tmp_path / "dp.pt")
    _assert_same(target, source)


def test_unwrap_knows_wrappers_by_type() -> None:
    model = OnlyChildNamedModule()
    assert ckpt.unwrap(model) is model  # not a wrapper, though its only child is called module
    assert ckpt.unwrap(nn.DataParallel(model)) is model
    assert ckpt.unwrap(multigpu.DataParallel(model, devices="cpu:2")) is model


def _collision_file(path: Path) -> Path:
    torch.save(
        {"module.weight": torch.ones(2), "_orig_mod.weight": torch.full((2,), 2.0), "weight": torch.zeros(2)}, path
    )
    return path


def test_keys_that_collapse_onto_one_name_are_refused_on_load(tmp_path: Path) -> None:
    class Vector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.full((2,), 5.0))

    model = Vector()
    with pytest.raises(CheckpointError, match=r"weight, module\.weight, _orig_mod\.weight -> weight.*ambiguous"):
        ckpt.load(model, _collision_file(tmp_path / "w.pt"))
    assert bool((model.weight == 5.0).all())


def test_keys_that_collapse_onto_one_name_are_refused_by_convert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.safetensors"
    assert main(["ckpt", "convert", str(_collision_file(tmp_path / "w.pt")), str(out)]) == 1
    err = capsys.readouterr().err
    assert "module.weight, _orig_mod.weight, weight -> weight" in err and "--keep-prefixes" in err
    assert not out.exists()
    assert main(["ckpt", "convert", str(tmp_path / "w.pt"), str(out), "--keep-prefixes"]) == 0
    assert sorted(read_tensors(out)[0]) == ["_orig_mod.weight", "module.weight", "weight"]


def test_strip_that_would_merge_keys_is_refused(tmp_path: Path) -> None:
    ckpt.save({"model.w": torch.ones(1), "w": torch.zeros(1)}, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.w, w -> w"):
        ckpt.load(nn.Module(), tmp_path / "a.safetensors", strip=("model.",))


def test_match_keys_prefers_the_mapping_that_fits_the_model() -> None:
    from multigpu.core.keys import match_keys

    assert match_keys(["module.a", "module.b"], ["a", "b"]) == {"module.a": "a", "module.b": "b"}
    assert match_keys(["a", "b"], ["module.a", "module.b"]) == {"a": "module.a", "b": "module.b"}
    assert match_keys(["module.a", "b"], ["module.a", "b"]) == {"module.a": "module.a", "b": "b"}
    assert match_keys(["module._orig_mod.a", "module.b"], ["a", "b"]) == {"module._orig_mod.a": "a", "module.b": "b"}
