"""ARCHITECTURE.md's recipes, followed: a toy device type and a toy strategy, each added in the one place its
recipe names, reach every place that should know them, and nothing else in src/ spells the built-in ones.

Each toy is registered for one test and unregistered after it, so other tests see nothing of it. The guards
read src's syntax trees: a device type's name spelled outside ``devices/``, or a list of strategy names
outside the files the strategy recipe names, is a place the recipe does not say, and fails here by file.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import multigpu
from multigpu.devices import DeviceType, device_type_names, register_device_type, unregister_device_type
from multigpu.strategies.dp import DataParallelStrategy
from multigpu.strategies.registry import register_strategy, strategy_names, unregister_strategy

SRC = Path(multigpu.__file__).parent
MAP = SRC.parents[1] / "ARCHITECTURE.md"


def _recipe(title: str) -> str:
    """The bullet of ARCHITECTURE.md's 'Where to change a given thing' that starts with ``title``."""
    found = re.search(rf"^- \*\*{re.escape(title)}\*\*:(.*?)(?=^- \*\*|^## )", MAP.read_text(), re.S | re.M)
    assert found is not None, f"ARCHITECTURE.md has no recipe '{title}'"
    return found.group(1)


def _named_files(recipe: str) -> set[str]:
    return set(re.findall(r"`([\w/]+\.py)`", recipe))


# -- a device type ----------------------------------------------------------------------------------------


class ToyDevice(DeviceType):
    """Four "hpu" devices of which a run takes three by default; torch's SyncBatchNorm runs on them."""

    name = "hpu"  # a device type torch.device knows, that no test machine has
    display = "TOY"
    backend = "toyccl"  # a backend of its own: workers compute on it
    torch_sync_batchnorm = True
    deterministic_env: ClassVar[Mapping[str, str]] = MappingProxyType({"TOY_DETERMINISTIC": "1"})

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 4

    def default_replicas(self) -> int:
        return 3

    def describe(self, index: int) -> str:
        return f"toy accelerator {index}"

    def versions(self) -> dict[str, str]:
        return {"toylib": "1.2"}


@pytest.fixture
def toy_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[ToyDevice]:
    if torch.cuda.is_available():
        pytest.skip("a real accelerator is found first; the toy type is looked up after it")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MULTIGPU_STRATEGY", "MULTIGPU_DEVICES", "TOY_DETERMINISTIC"):
        monkeypatch.delenv(key, raising=False)  # not launched: the defaults decide
    toy = register_device_type(ToyDevice())  # the recipe's one place
    try:
        yield toy  # type: ignore[misc]
    finally:
        unregister_device_type("hpu")
    assert "hpu" not in device_type_names()


def test_a_device_type_registered_once_answers_every_default(toy_device: ToyDevice) -> None:
    from multigpu.cli._advise_measure import devices_present, present_accelerator
    from multigpu.cli.demo import default_devices
    from multigpu.devices import parse_devices, process_device_type, replica_device_type, several_accelerators
    from multigpu.launcher.launch import LaunchConfig
    from multigpu.launcher.measure import _dp_devices
    from multigpu.launcher.torchrun import resolve_nproc
    from multigpu.strategies.registry import resolve_strategy_name

    assert process_device_type() is toy_device and replica_device_type() is toy_device
    assert several_accelerators() is toy_device
    # the default replica count: dp's replicas, launch's processes, the demo, advise --measure
    strategy = DataParallelStrategy.build()
    assert [r.label for r in strategy.replicas] == ["hpu:0", "hpu:1", "hpu:2"]
    assert [r.label for r in parse_devices(None)] == ["hpu:0", "hpu:1", "hpu:2", "hpu:3"]  # every device
    assert resolve_nproc(LaunchConfig(nproc_per_node="auto")) == 3
    assert default_devices() == "hpu:0,1,2"
    assert devices_present() == 3 and present_accelerator() == "hpu" and _dp_devices(2) == "hpu:0,1"
    assert resolve_strategy_name("auto") == "dp"  # several devices of the workers' type, one process


@pytest.mark.multiprocess  # collect_env: platform.processor() runs uname in a process
def test_a_device_type_registered_once_is_listed_by_multigpu_env(toy_device: ToyDevice) -> None:
    from multigpu.profiling.environment import collect_env

    text = collect_env().to_text()
    for index in range(4):
        assert f"hpu:{index}" in text and f"toy accelerator {index}" in text
    assert "toylib" in text and "1.2" in text


def test_a_device_type_answers_determinism_and_sync_batchnorm(
    toy_device: ToyDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    from multigpu.session.determinism import apply_deterministic
    from multigpu.strategies.sync_batchnorm import CPUSyncBatchNorm, apply_sync_batchnorm

    monkeypatch.setenv("TOY_DETERMINISTIC", "")  # monkeypatch now removes what apply_deterministic sets
    monkeypatch.delenv("TOY_DETERMINISTIC")
    restore = apply_deterministic(torch.device("hpu", 0))
    try:
        assert os.environ["TOY_DETERMINISTIC"] == "1"
    finally:
        restore()
    monkeypatch.setenv("TOY_DETERMINISTIC", "mine")
    apply_deterministic(torch.device("hpu", 0))()
    assert os.environ["TOY_DETERMINISTIC"] == "mine"  # the user's setting is kept

    assert isinstance(
        apply_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)), torch.device("hpu", 0))[0], nn.SyncBatchNorm
    )
    monkeypatch.setattr(ToyDevice, "torch_sync_batchnorm", False)
    converted = apply_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)), torch.device("hpu", 0))
    assert isinstance(converted[0], CPUSyncBatchNorm)


def test_the_device_recipe_names_every_answer_the_test_checks() -> None:
    recipe = _recipe("A device type")
    for named in ("default_replicas", "replicas_spec", "torch_sync_batchnorm", "deterministic_env", "describe"):
        assert named in recipe, f"the device type recipe does not name {named}"
    for path in ("devices/registry.py", "devices/base.py", "session/determinism.py", "strategies/sync_batchnorm.py"):
        assert path in _named_files(recipe)


def _spelled(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, text) of every string constant that is not a docstring."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_module_outside_devices_names_an_accelerator_type() -> None:
    """``if device.type == "cuda"`` outside ``devices/`` is a place the recipe does not name: ask the object."""
    accelerators = set(device_type_names()) - {"cpu"}
    found = [
        f"{path.relative_to(SRC)}:{line} {text!r}"
        for path in sorted(SRC.rglob("*.py"))
        if path.relative_to(SRC).parts[0] != "devices"
        for line, text in _spelled(ast.parse(path.read_text()))
        if text in accelerators
    ]
    assert found == [], f"ask the device type object (multigpu.devices) instead of spelling its name: {found}"


# -- a strategy -------------------------------------------------------------------------------------------


class ToyStrategy(DataParallelStrategy):
    """dp under another name: a strategy whose facts are all its own class attributes."""

    name: ClassVar[str] = "toy"
    label: ClassVar[str] = "toy DataParallel"
    variants: ClassVar[Mapping[str, str]] = {}


@pytest.fixture
def toy_strategy(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[ToyStrategy]]:
    for key in ("RANK", "WORLD_SIZE", "MULTIGPU_STRATEGY", "MULTIGPU_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    register_strategy(ToyStrategy)  # the recipe's one place for its facts
    try:
        yield ToyStrategy
    finally:
        unregister_strategy("toy")
    assert "toy" not in strategy_names()


def _choices(add_arguments: Any, dest: str) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return next(a for a in parser._actions if a.dest == dest)


def test_a_strategy_registered_once_is_a_choice_everywhere(toy_strategy: type[ToyStrategy]) -> None:
    from multigpu.cli import _advise_measure, advise, launch
    from multigpu.launcher.launch import LaunchConfig
    from multigpu.session.config import SessionConfig
    from multigpu.strategies import STRATEGIES, build_strategy, get_strategy, multi_device_strategies, strategy_labels

    assert "toy" in _choices(launch.add_arguments, "strategy").choices  # multigpu launch --strategy
    assert LaunchConfig(strategy="toy").strategy == "toy"
    assert SessionConfig(strategy="toy").strategy == "toy"  # Session(strategy=...)
    assert "toy" in _choices(advise.add_arguments, "strategies").help  # advise --measure --strategies' default
    measured = _advise_measure.strategies(argparse.Namespace(strategies=None))
    assert measured == ["single", "dp", "ddp", "fsdp", "toy"]
    runs = _advise_measure.build_runs([1, 2], ["single", "toy"], [], {"per_device_batch": 4})
    assert [(r.strategy, r.devices) for r in runs] == [("single", 1), ("toy", 2)]  # multi_device: at 2
    assert get_strategy("toy") is STRATEGIES["toy"] is ToyStrategy
    assert strategy_labels()["toy"] == "toy DataParallel" and "toy" in multi_device_strategies()
    built = build_strategy("toy", devices="cpu:2")
    assert isinstance(built, ToyStrategy) and [r.label for r in built.replicas] == ["cpu:0", "cpu:1"]


def test_a_strategy_gets_its_planner_row_from_its_facts(toy_strategy: type[ToyStrategy]) -> None:
    """The planner's row is the recipe's second place (an equation, not a fact): its label and kind come
    from the registered class."""
    from multigpu.planning import costs, memory

    row = costs._planned("toy", costs.dataparallel_step, memory.dataparallel_memory)
    assert (row.label, row.multi_device, row.one_process) == ("toy DataParallel", True, True)


def test_a_registered_strategy_name_is_refused_twice_and_auto_is_reserved(toy_strategy: type[ToyStrategy]) -> None:
    from multigpu.errors import ConfigError

    with pytest.raises(ConfigError, match=r"strategy 'toy' is registered already .*unregister_strategy\('toy'\)"):
        register_strategy(ToyStrategy)

    class Auto(ToyStrategy):
        name: ClassVar[str] = "auto"

    with pytest.raises(ConfigError, match="'auto'"):
        register_strategy(Auto)


def _strategy_lists(tree: ast.AST, names: set[str]) -> Iterator[int]:
    """Lines of every literal tuple, list, set or dict (keys) holding two or more strategy names."""
    for node in ast.walk(tree):
        items: list[Any] = []
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = list(node.elts)
        elif isinstance(node, ast.Dict):
            items = [key for key in node.keys if key is not None]
        elif isinstance(node, ast.BoolOp):  # name == "single" or name == "dp"
            items = [c for v in node.values if isinstance(v, ast.Compare) for c in v.comparators]
        spelled = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
        if len(spelled) >= 2:
            yield node.lineno


def test_no_module_the_strategy_recipe_does_not_name_lists_strategies() -> None:
    """A list of strategy names is a place a new strategy must be added: only the recipe's files may hold one."""
    from multigpu.strategies import strategy_labels

    named = _named_files(_recipe("A strategy"))
    assert "strategies/registry.py" in named
    found = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        if str(path.relative_to(SRC)) not in named
        for line in _strategy_lists(ast.parse(path.read_text()), set(strategy_labels()))
    ]
    assert found == [], (
        f"ask multigpu.strategies.registry instead of listing strategy names (or add the file to ARCHITECTURE.md's recipe): {found}"
    )


def test_the_list_guard_sees_a_list() -> None:
    names = {"single", "dp", "ddp"}
    tree = ast.parse('A = ("single", "dp")\nB = {"ddp": 1, "x": 2}\nC = x == "single" or x == "ddp"\nD = ["dp"]\n')
    assert list(_strategy_lists(tree, names)) == [1, 3]
