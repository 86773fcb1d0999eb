"""A damaged training state is refused before anything changes: model, optimizer, scheduler, scaler, RNG.

Each case damages one entry of a real ``state.pt`` (saved after a real training step) and
requires ``CheckpointError`` naming the file and the entry, with every object as before.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.errors import CheckpointError, ConfigError
from tests.checkpoint import _training as tr


def _saved(folder: Path) -> Path:
    tr.seed_everything(3)
    parts = tr.build_parts()
    tr.train_step(parts, 0)
    return ckpt.Checkpointer(folder=folder).save(
        step=1,
        model=parts.model,
        optimizer=parts.optimizer,
        scheduler=parts.scheduler,
        scaler=parts.scaler,
        epoch=0,
        data_position={"batch": 1},
    )


def _set(path: tuple[Any, ...], value: Any) -> Callable[[Any], Any]:
    def change(state: Any) -> Any:
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return state

    return change


def _drop(key: str) -> Callable[[Any], Any]:
    def change(state: Any) -> Any:
        del state[key]
        return state

    return change


DAMAGE: dict[str, tuple[Callable[[Any], Any], str]] = {
    "state is a list": (lambda s: [1, 2, 3], r"the state is \[1, 2, 3\]; expected a dict"),
    "no rng entry": (_drop("rng"), r"entry 'rng' is 'missing'"),
    "torch rng of the wrong size": (
        _set(("rng", 0, "torch"), torch.zeros(10, dtype=torch.uint8)),
        r"entry 'rng'\[0\]\['torch'\].*expected a uint8 tensor of shape",
    ),
    "python rng of the wrong size": (_set(("rng", 0, "python"), (3, (1, 2, 3), None)), r"entry 'rng'\[0\]\['python'\]"),
    "numpy rng out of range": (
        _set(("rng", 0, "numpy", "keys"), torch.full((624,), -1, dtype=torch.int64)),
        r"entry 'rng'\[0\]\['numpy'\]",
    ),
    "rng list shorter than the world": (_set(("rng",), []), r"entry 'rng' is \[\]; expected a list of 1"),
    "optimizer groups missing": (
        _set(("optimizer", "param_groups"), []),
        r"entry 'optimizer'\['param_groups'\] is \[\]; expected a list of 1 groups",
    ),
    "optimizer buffer of the wrong shape": (
        _set(("optimizer", "state", 0, "momentum_buffer"), torch.zeros(3)),
        r"\['momentum_buffer'\] is 'a tensor of shape \(3,\)'; expected its parameter's shape \(48, 64\)",
    ),
    "optimizer state of an unknown parameter": (
        _set(("optimizer", "state", 99), {"momentum_buffer": torch.zeros(1)}),
        r"entry 'optimizer'\['state'\]\[99\]",
    ),
    "optimizer state a list": (_set(("optimizer", "state"), []), r"entry 'optimizer'\['state'\] is \[\]"),
    "optimizer lr a string": (
        _set(("optimizer", "param_groups", 0, "lr"), "fast"),
        r"\['param_groups'\]\[0\]\['lr'\] is 'fast'; expected a number",
    ),
    "scheduler with an attribute it does not save": (
        _set(("scheduler", "optimizer"), 5),
        r"entry 'scheduler' is \"keys \['optimizer'\]\"",
    ),
    "scheduler counter a string": (
        _set(("scheduler", "last_epoch"), "x"),
        r"entry 'scheduler'\['last_epoch'\] is 'x'; expected a number",
    ),
    "scaler scale a string": (_set(("scaler", "scale"), "big"), r"entry 'scaler'\['scale'\] is 'big'"),
    "scaler scale negative": (_set(("scaler", "scale"), -1.0), r"entry 'scaler'\['scale'\] is -1.0"),
    "step a path": (_set(("step",), "../../etc"), r"entry 'step' is '\.\./\.\./etc'; expected an int"),
    "step of another folder": (_set(("step",), 7), r"entry 'step' is 7; expected 1, the step in the folder's name"),
    "step a bool": (_set(("step",), True), r"entry 'step' is True"),
    "epoch negative": (_set(("epoch",), -1), r"entry 'epoch' is -1; expected an int from 0"),
    "world size zero": (_set(("world_size",), 0), r"entry 'world_size' is 0"),
    "data position a list": (_set(("data_position",), [1]), r"entry 'data_position' is \[1\]; expected a dict"),
    "data position holding itself": (
        lambda s: _set(("data_position", "me"), s["data_position"])(s),
        r"holding itself",
    ),
    "format from the future": (_set(("format_version",), 2), r"entry 'format_version' is 2"),
}


def _random_state() -> tuple[Any, ...]:
    return (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())


def _everything(parts: tr.Parts) -> dict[str, Any]:
    return {
        "model": copy.deepcopy(parts.model.state_dict()),
        "optimizer": copy.deepcopy(parts.optimizer.state_dict()),
        "scheduler": copy.deepcopy(parts.scheduler.state_dict()),
        "scaler": copy.deepcopy(parts.scaler.state_dict()),
    }


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_state_changes_nothing_and_names_the_entry(tmp_path: Path, case: str) -> None:
    folder = _saved(tmp_path)
    change, expected = DAMAGE[case]
    state = torch.load(folder / "state.pt", weights_only=True)
    torch.save(change(state), folder / "state.pt")

    tr.seed_everything(11)
    fresh = tr.build_parts(nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.2), nn.Linear(48, 10)))
    tr.train_step(fresh, 5)  # the live objects hold state of their own, which must survive
    before, rng_before = _everything(fresh), _random_state()
    with pytest.raises(CheckpointError, match=r"state\.pt': .*" + expected) as info:
        ckpt.Checkpointer(folder=tmp_path).resume(
            model=fresh.model, optimizer=fresh.optimizer, scheduler=fresh.scheduler, scaler=fresh.scaler
        )
    assert "Nothing was loaded" in str(info.value)
    _assert_same(_everything(fresh), before)
    _assert_same(_random_state(), rng_before)


@pytest.mark.parametrize("bound", [True, False], ids=["state-names-its-weights", "older-state-without-checksum"])
def test_a_weights_file_of_another_save_changes_nothing(tmp_path: Path, bound: bool) -> None:
    folder = _saved(tmp_path)
    other = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Dropout(0.2), nn.Linear(48, 7))
    ckpt.save(other, folder / "model.safetensors")
    if not bound:  # as a folder saved before checksums: neither state.pt nor a manifest names the weights
        state = torch.load(folder / "state.pt", weights_only=True)
        del state["model_checksum"]
        torch.save(state, folder / "state.pt")
        (folder / "manifest.json").unlink()
    fresh = tr.build_parts()
    tr.train_step(fresh, 5)
    before = _everything(fresh)
    expected = (
        r"model\.safetensors' has \d+ bytes; the manifest records \d+ \(the file was truncated or replaced\)"
        if bound
        else r"model\.safetensors' does not match Sequential.*3\.weight"
    )
    with pytest.raises(CheckpointError, match=expected):
        ckpt.Checkpointer(folder=tmp_path).resume(model=fresh.model, optimizer=fresh.optimizer)
    _assert_same(_everything(fresh), before)


def test_an_incomplete_folder_given_by_path_is_named(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    (folder / "state.pt").unlink()
    with pytest.raises(CheckpointError, match=r"not a complete checkpoint folder \(state\.pt missing"):
        ckpt.Checkpointer(folder=tmp_path).resume(model=tr.build_model(), path=folder)
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is not a complete checkpoint folder"):
        ckpt.Checkpointer(folder=tmp_path).resume(model=tr.build_model(), path=folder / "model.safetensors")


def test_a_failing_load_state_dict_puts_everything_back(tmp_path: Path) -> None:
    # Past every check, a custom scheduler still raises: what was applied is put back.
    folder = _saved(tmp_path)
    fresh = tr.build_parts()
    tr.train_step(fresh, 5)
    before = _everything(fresh)

    class Refuses(torch.optim.lr_scheduler.StepLR):
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            raise ValueError("custom scheduler refuses")

    refusing = Refuses(fresh.optimizer, step_size=3, gamma=0.5)
    state = torch.load(folder / "state.pt", weights_only=True)
    state["scheduler"] = fresh.scheduler.state_dict()
    torch.save(state, folder / "state.pt")
    fresh.scheduler = refusing
    before["scheduler"] = copy.deepcopy(refusing.state_dict())
    with pytest.raises(CheckpointError, match=r"applying the scheduler state failed \(ValueError: custom"):
        ckpt.Checkpointer(folder=tmp_path).resume(
            model=fresh.model, optimizer=fresh.optimizer, scheduler=fresh.scheduler, scaler=fresh.scaler
        )
    _assert_same(_everything(fresh), before)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (True, r"step=True must be an int \(got bool\)"),
        (1.5, r"step=1\.5 must be an int \(got float\)"),
        ("3", r"step='3' must be an int"),
        (-1, r"step=-1 must be between 0 and 9223372036854775807"),
        (2**70, r"step=1180591620717411303424 must be between 0"),
    ],
)
def test_save_checks_step_type_and_range(tmp_path: Path, step: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ckpt.Checkpointer(folder=tmp_path).save(step=step, model=nn.Linear(2, 2))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_save_refuses_a_data_position_holding_itself(tmp_path: Path) -> None:
    position: dict[str, Any] = {}
    position["self"] = position
    with pytest.raises(ConfigError, match=r"data_position\['self'\].* is a container holding itself"):
        ckpt.Checkpointer(folder=tmp_path).save(step=1, model=nn.Linear(2, 2), data_position=position)


def test_save_refuses_non_string_keys_that_resume_would_refuse(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data_position has the key 1; its keys must be strings"):
        ckpt.Checkpointer(folder=tmp_path).save(step=1, model=nn.Linear(2, 2), data_position={1: 2})
