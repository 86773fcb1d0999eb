"""Generated state dicts read back through every reader, bit for bit: ``multigpu.save``/``load`` in both formats,
``multigpu ckpt convert`` and ``inspect``, and a ``Checkpointer``'s save and resume (blocking and async).

The states are drawn by hypothesis: every dtype multigpu loads (bfloat16, float16, int8, bool, complex among them),
0-d and empty tensors, transposed and strided views (one element with a stride of 2 among them), lazy conj() and
negative views (the values shown are not the memory's), one tensor under two names, keys of any characters but the
module path's dot, and no tensor at all (a model without parameters). The oracle is the tensors themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import multigpu
from multigpu.checkpoint import Checkpointer
from multigpu.cli.main import main
from multigpu.errors import CheckpointError, ConfigError

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int64,
]
DTYPES += [torch.bool, torch.complex64]
NAMES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="."), min_size=1, max_size=6)
SPECS = st.dictionaries(
    NAMES,
    st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 3), max_size=3),
        st.sampled_from(["plain", "t", "step", "lazy"]),
    ),
    max_size=4,  # none: a model without parameters or buffers (nn.ReLU()) saves an empty state dict
)
FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))


def _tensor(dtype: torch.dtype, shape: list[int], layout: str) -> torch.Tensor:
    count = 1
    for size in shape:
        count *= size
    values = torch.arange(1, 2 * count + 1) % 7 - 3
    if layout == "step":  # every other element of a longer tensor
        return (
            values[::2].to(dtype)[:count].reshape(shape)
            if dtype is not torch.bool
            else values[::2][:count].reshape(shape) > 0
        )
    tensor = values[:count].reshape(shape)
    tensor = tensor > 0 if dtype is torch.bool else tensor.to(dtype)
    if layout == "lazy" and dtype.is_complex:  # conj() is a lazy view: the values shown differ from the memory
        return tensor.conj()
    if layout == "lazy" and dtype in (torch.float32, torch.float64):  # and its imaginary part, a negative view
        negative = torch.complex(-tensor, -tensor).conj().imag
        assert negative.is_neg() and torch.equal(negative, tensor)
        return negative
    return tensor.transpose(0, 1) if layout == "t" and len(shape) >= 2 else tensor


def _state(specs: dict[str, tuple[torch.dtype, list[int], str]], tie: bool) -> dict[str, torch.Tensor]:
    state = {name: _tensor(*spec) for name, spec in specs.items()}
    if tie and state:
        first = next(iter(state))
        state[first + "-tied"] = state[first]
    return state


def _holder(state: dict[str, torch.Tensor]) -> nn.Module:
    module = nn.Module()
    for name, tensor in state.items():
        module.register_buffer(name, torch.zeros(tensor.shape, dtype=tensor.dtype))
    return module


def _same(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    loaded = module.state_dict()
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@FUZZ
@given(specs=SPECS, tie=st.booleans(), suffix=st.sampled_from([".safetensors", ".pt"]))
def test_save_then_load_and_convert_give_the_same_tensors(
    specs: dict[str, tuple[torch.dtype, list[int], str]], tie: bool, suffix: str, tmp_path_factory: object
) -> None:
    folder = tmp_path_factory.mktemp("w")  # type: ignore[attr-defined]
    state = _state(specs, tie)
    path = multigpu.save(state, folder / f"w{suffix}")
    _same(multigpu.load(_holder(state), path), state)
    other = folder / ("w.pt" if suffix == ".safetensors" else "w.safetensors")
    assert main(["ckpt", "convert", str(path), str(other)]) == 0
    _same(multigpu.load(_holder(state), other), state)
    assert main(["ckpt", "inspect", str(other), "--max-keys", "0"]) == 0


@FUZZ
@given(specs=SPECS, tie=st.booleans(), async_save=st.booleans())
def test_a_checkpointer_resumes_the_same_tensors(
    specs: dict[str, tuple[torch.dtype, list[int], str]], tie: bool, async_save: bool, tmp_path_factory: object
) -> None:
    folder = tmp_path_factory.mktemp("c")  # type: ignore[attr-defined]
    state = _state(specs, tie)
    saved = nn.Module()
    for name, tensor in state.items():  # the views themselves, as a model may hold them
        saved.register_buffer(name, tensor)
    with Checkpointer(folder=folder, async_save=async_save) as checkpointer:
        checkpointer.save(step=3, model=saved)
    resumed = _holder(state)
    assert Checkpointer(folder=folder).resume(model=resumed).step == 3
    _same(resumed, state)
    _same(multigpu.load(_holder(state), folder / "step-00000003"), state)
    assert main(["ckpt", "inspect", str(folder)]) == 0


def test_a_tensor_without_data_in_extra_is_refused_at_save(tmp_path: Path) -> None:
    # saved, it came back as a meta tensor from every resume: nothing of it was in the file
    with pytest.raises(ConfigError, match=r"extra\['t'\] is .*on meta"):
        Checkpointer(folder=tmp_path).save(step=1, model=nn.Linear(2, 2), extra={"t": torch.empty(2, device="meta")})
    assert not any(tmp_path.iterdir())


class _WithExtraState(nn.Linear):
    def get_extra_state(self) -> dict[str, int]:
        return {"calls": 3}

    def set_extra_state(self, state: dict[str, int]) -> None:
        pass


def test_a_modules_extra_state_is_refused_naming_it_in_every_writer(tmp_path: Path) -> None:
    says = r"'_extra_state', a dict \(a module's get_extra_state\?\), not a tensor.*extra="
    for name in ("w.safetensors", "w.pt"):
        with pytest.raises(ConfigError, match=says):
            multigpu.save(_WithExtraState(2, 2), tmp_path / name)
    with pytest.raises(ConfigError, match=says):
        Checkpointer(folder=tmp_path / "c").save(step=1, model=_WithExtraState(2, 2))
    with pytest.raises(CheckpointError, match=says):
        with Checkpointer(folder=tmp_path / "a", async_save=True) as checkpointer:
            checkpointer.save(step=1, model=_WithExtraState(2, 2))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == []


@pytest.mark.parametrize("dtype", ["complex128", "complex32", "bits8", "float4_e2m1fn_x2"])
@pytest.mark.parametrize("name", ["w.safetensors", "w.pt", "folder"])
def test_a_dtype_the_format_cannot_hold_is_refused_at_save_naming_it(tmp_path: Path, dtype: str, name: str) -> None:
    # safetensors' writer raised KeyError on complex128, complex32 and bits8, and wrote float4 in a file our own
    # reader refuses (the message named the partial file); the torch format wrote what multigpu.load then refused
    kind = getattr(torch, dtype, None)
    if kind is None:
        pytest.skip(f"this torch has no {dtype}")
    state = {"w": torch.zeros(2, dtype=torch.uint8).view(kind) if kind.itemsize == 1 else torch.zeros(2, dtype=kind)}
    holds = name == "w.pt" and kind is torch.complex128  # the torch format holds it, and load reads it back
    says = rf"'w' .*{kind}.*(torch format|cast)"
    if name == "folder":
        module = nn.Module()
        module.register_buffer("w", state["w"])
        with pytest.raises(ConfigError, match=says):
            Checkpointer(folder=tmp_path / "c").save(step=1, model=module)
    elif holds:
        _same(multigpu.load(_holder(state), multigpu.save(state, tmp_path / name)), state)
        return
    else:
        with pytest.raises(ConfigError, match=says):
            multigpu.save(state, tmp_path / name)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file() and p.name != ".multigpu.lock"] == []


@pytest.mark.parametrize("name", ["w.safetensors", "w.pt"])
def test_a_model_without_weights_reads_back_through_every_reader(tmp_path: Path, name: str) -> None:
    # the torch file of nn.ReLU() was written, then refused by load, inspect and convert ("no flat mapping")
    path = multigpu.save(nn.ReLU(), tmp_path / name)
    multigpu.load(nn.ReLU(), path)
    assert main(["ckpt", "inspect", str(path)]) == 0
    assert main(["ckpt", "convert", str(path), str(tmp_path / "other.pt")]) == 0
    multigpu.load(nn.ReLU(), tmp_path / "other.pt")


@pytest.mark.parametrize("name", ["w.safetensors", "w.pt"])
@pytest.mark.parametrize(
    ("state", "says"),
    [  # safetensors' writer raised NotImplementedError, or the torch file was written and then refused by load
        ({"w": torch.eye(2).to_sparse()}, r"'w', a torch.sparse_coo tensor; .*\.to_dense\(\)"),
        ({"w": torch.empty(2, device="meta")}, r"'w', a meta tensor; .*to_empty"),
        ({1: torch.ones(2)}, r"the key 1 of type int; a state dict's keys are strings"),  # a TypeError
    ],
    ids=["sparse", "meta", "int key"],
)
def test_what_no_weights_file_holds_is_refused_at_save_naming_it(
    tmp_path: Path, name: str, state: dict, says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        multigpu.save(state, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_safetensors_file_gets_the_mode_every_other_file_gets(tmp_path: Path, umask: int) -> None:
    # safetensors 0.8 renames a 0600 temporary into place: teammates (or a serving container's user) could
    # not read the weights beside a readable state.pt (https://github.com/safetensors/safetensors/issues/782)
    previous = os.umask(umask)
    try:
        (tmp_path / "plain.json").write_text("{}")
        multigpu.save(nn.Linear(2, 2), tmp_path / "w.safetensors")
        Checkpointer(folder=tmp_path / "c").save(step=1, model=nn.Linear(2, 2))
    finally:
        os.umask(previous)
    mode = (tmp_path / "plain.json").stat().st_mode & 0o777
    assert mode == 0o666 & ~umask
    written = [tmp_path / "w.safetensors", tmp_path / "c" / "step-00000001" / "model.safetensors"]
    assert [oct(p.stat().st_mode & 0o777) for p in written] == [oct(mode)] * 2
