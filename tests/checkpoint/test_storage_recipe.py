"""ARCHITECTURE.md's recipe for a checkpoint storage is the whole recipe: a toy storage added where it says appears everywhere.

The toy keeps the model as a torch file ``toy.pt`` ({"step", "model"}) and its own checksum (a CRC-32
of that file). Registered by the one line the recipe names (``storages.STORAGES``), it must be
recognised, complete, its step read, pruned and re-saved, shown by ``multigpu ckpt inspect``, read by
``multigpu.load`` and ``ckpt convert``, and saved and resumed by a Checkpointer (blocking and
``async_save``). The static check fails when a module the recipe does not name starts to know a
storage: a storage's class or one of its files named outside the storage's own modules.
"""

from __future__ import annotations

import ast
import os
import re
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import multigpu
import multigpu.checkpoint as ckpt
from multigpu.checkpoint import storages
from multigpu.checkpoint.atomic import STATE_FILE, regular_files
from multigpu.checkpoint.ranks import Staging
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.checkpoint.validate import Refusal, TrainingState
from multigpu.checkpoint.weights import summarize
from multigpu.cli.main import main
from multigpu.core.keys import plan_load, unwrap
from multigpu.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "multigpu" / "checkpoint"
TOY_FILE = "toy.pt"


class ToyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)


class Toy:
    """A storage in the shape the recipe asks for: one torch file and a CRC-32 of it."""

    name: ClassVar[str] = "toy"
    files: ClassVar[tuple[str, ...]] = (TOY_FILE,)
    collective: ClassVar[bool] = False

    def __init__(self, model: nn.Module | None, optimizer: Any | None, *, folder: Path | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self.snapshot: tuple[Mapping[str, torch.Tensor], Any] | None = None
        self.weights_read: dict[str, torch.Tensor] = {}

    @classmethod
    def serves(cls, model: nn.Module) -> bool:
        return isinstance(unwrap(model), ToyNet)

    @classmethod
    def holds(cls, folder: Path) -> bool:
        return os.path.lexists(folder / TOY_FILE)

    @classmethod
    def is_complete(cls, folder: Path) -> bool:
        return regular_files(folder, (TOY_FILE, STATE_FILE))

    @classmethod
    def recorded_step(cls, folder: Path) -> int | None:
        try:
            return int(load_torch_file(folder / TOY_FILE)["step"])
        except (CheckpointError, OSError):
            return None

    @classmethod
    def describe(cls, folder: Path, *, allow_unsafe_pickle: bool) -> tuple[Any, ...]:
        model = load_torch_file(folder / TOY_FILE)["model"]
        structure = [(k, tuple(v.shape), v.dtype) for k, v in model.items()]
        return folder / TOY_FILE, cls.name, (folder / TOY_FILE).stat().st_size, structure, {}, {"toy facts": "yes"}

    @classmethod
    def read_weights(
        cls, folder: Path, *, allow_unsafe_pickle: bool, max_expansion: float
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        saved = load_torch_file(folder / TOY_FILE)
        return dict(saved["model"]), {"step": str(saved["step"])}

    def staged(self, staging: Staging) -> Toy:
        assert self.model is not None
        copy = Toy(None, None)
        copy.snapshot = staging.copy((unwrap(self.model).state_dict(), self.saved_optimizer()))
        return copy

    def saved_optimizer(self) -> Any:
        if self.snapshot is not None:
            return self.snapshot[1]
        return None if self.optimizer is None else self.optimizer.state_dict()

    def write(self, tmp: Path, target: Path, step: int) -> str:
        if self.snapshot is not None:
            weights = self.snapshot[0]
        else:
            assert self.model is not None
            weights = unwrap(self.model).state_dict()
        torch.save({"step": step, "model": dict(weights)}, tmp / TOY_FILE)
        return f"toy:crc32:{zlib.crc32((tmp / TOY_FILE).read_bytes()):08x}"

    def seal(self, tmp: Path, written: list[Any], step: int, world_size: int) -> str:
        return str(written[0])

    def read(self, locate: Callable[[], Path | None], *, allow_unsafe_pickle: bool) -> tuple[Path, Any] | None:
        folder = locate()
        return None if folder is None else (folder, load_torch_file(folder / STATE_FILE))

    def check(self, folder: Path, checked: TrainingState) -> bool:
        found = f"toy:crc32:{zlib.crc32((folder / TOY_FILE).read_bytes()):08x}"
        if found != checked.model_checksum:
            Refusal(folder / TOY_FILE).fail("its checksum", found, str(checked.model_checksum))
        assert self.model is not None
        self.weights_read = plan_load(self.model, load_torch_file(folder / TOY_FILE)["model"], source="toy")
        return False

    def load(self, folder: Path, *, allow_unsafe_pickle: bool) -> None:
        pass

    def apply(self) -> None:
        assert self.model is not None
        unwrap(self.model).load_state_dict(self.weights_read)

    def discard(self) -> None:
        self.weights_read = {}

    def agreed(self, compute: Callable[[], Any]) -> Any:
        return compute()


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one line of the recipe: the storage in ``STORAGES``."""
    monkeypatch.setattr(storages, "STORAGES", (Toy, *storages.STORAGES))


def _trained() -> tuple[ToyNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = ToyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.a(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async_save"])
def test_a_toy_storage_is_saved_found_and_resumed_by_a_checkpointer(
    toy: None, tmp_path: Path, async_save: bool
) -> None:
    model, opt = _trained()
    with ckpt.Checkpointer(folder=tmp_path, keep_last=2, async_save=async_save) as saver:
        for step in (1, 2, 3):
            saver.save(step=step, model=model, optimizer=opt)
        saver.wait()
        folder = saver.save(step=3, model=model, optimizer=opt)  # a re-save: the step's own files record it
    assert sorted(p.name for p in folder.iterdir()) == [STATE_FILE, TOY_FILE]
    assert storages.storage_of(folder) is Toy and storages.is_complete(folder)
    assert storages.recorded_step_of(folder) == 3
    assert ckpt.find_latest(tmp_path) == folder and saver.steps() == [2, 3]  # keep_last pruned step 1
    fresh = ToyNet()
    again = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    resumed = ckpt.Checkpointer(folder=tmp_path).resume(model=fresh, optimizer=again)
    assert resumed is not None and resumed.step == 3
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)
    assert again.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_a_toy_storage_checks_its_own_checksum_on_resume(toy: None, tmp_path: Path) -> None:
    model, opt = _trained()
    folder = ckpt.Checkpointer(folder=tmp_path).save(step=1, model=model, optimizer=opt)
    torch.save({"step": 1, "model": ToyNet().state_dict()}, folder / TOY_FILE)  # weights of another save
    with pytest.raises(CheckpointError, match=r"toy\.pt': its checksum is"):
        ckpt.Checkpointer(folder=tmp_path).resume(model=ToyNet())


def test_an_incomplete_toy_folder_is_skipped_naming_the_toy_files(toy: None, tmp_path: Path) -> None:
    model, opt = _trained()
    ckpt.Checkpointer(folder=tmp_path).save(step=1, model=model, optimizer=opt)
    (tmp_path / "step-00000002").mkdir()
    torch.save({"step": 2, "model": model.state_dict()}, tmp_path / "step-00000002" / TOY_FILE)  # no state.pt
    with pytest.warns(RuntimeWarning, match=r"ignoring 1 entries .*step-00000002.*toy\.pt"):
        assert ckpt.find_latest(tmp_path) == tmp_path / "step-00000001"


def test_a_toy_storage_is_shown_by_inspect_and_read_by_load_and_convert(
    toy: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, opt = _trained()
    folder = ckpt.Checkpointer(folder=tmp_path / "run").save(step=7, model=model, optimizer=opt)
    for path in (folder, tmp_path / "run"):  # the step folder, and the Checkpointer's folder (its latest step)
        summary = summarize(path)
        assert (summary.format, summary.step, summary.path) == ("toy", 7, folder / TOY_FILE)
        assert [t.key for t in summary.tensors] == ["a.weight", "a.bias"]
        assert summary.training_state["toy facts"] == "yes" and summary.training_state["optimizer"] is True
    assert main(["ckpt", "inspect", str(folder)]) == 0
    shown = capsys.readouterr().out
    assert "toy" in shown and "a.weight" in shown
    loaded, again = ToyNet(), ToyNet()
    multigpu.load(loaded, folder)
    assert torch.equal(loaded.a.weight, model.a.weight)
    assert main(["ckpt", "convert", str(tmp_path / "run"), str(tmp_path / "out.safetensors")]) == 0
    multigpu.load(again, tmp_path / "out.safetensors")
    assert torch.equal(again.a.weight, model.a.weight)


# --- the recipe names every place ---------------------------------------------------------------


def _recipe() -> str:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    found = re.search(r"^- \*\*A checkpoint storage\*\*(.*?)(?=^- \*\*)", text, re.M | re.S)
    assert found, "ARCHITECTURE.md lost its recipe for a checkpoint storage"
    return found.group(1)


def _knowledge_of_storages() -> set[str]:
    """What only a storage's own modules may name: the storages' classes and their files' constants and names."""
    names = {s.__name__ for s in storages.STORAGES}
    literals = {f for s in storages.STORAGES for f in s.files}
    for module in {s.__module__ for s in storages.STORAGES}:
        tree = ast.parse((PACKAGE / f"{module.rsplit('.', 1)[1]}.py").read_text())
        for node in ast.walk(tree):  # a constant holding a file name: MODEL_FILE = "model.safetensors"
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value in literals:
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names | literals


def _named(recipe: str, sentence: str) -> set[str]:
    found = re.search(re.escape(sentence) + r"(.*?)\.(?:\s|$)", recipe, re.S)
    assert found, f"ARCHITECTURE.md's recipe for a checkpoint storage lost its sentence {sentence!r}"
    return set(re.findall(r"`checkpoint/([a-z_]+\.py)`", found.group(1)))


def test_the_recipe_names_every_module_that_knows_a_storage() -> None:
    recipe = _recipe()
    own = _named(recipe, "The storages now:") | {"storages.py"}  # the storages' modules, and the list
    asking = _named(recipe, "That is all:")  # the places that ask the list
    knowledge = _knowledge_of_storages()
    knowing = set()
    for path in sorted((ROOT / "src" / "multigpu").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            token = node.id if isinstance(node, ast.Name) else node.value if isinstance(node, ast.Constant) else None
            token = node.name if isinstance(node, ast.alias) else token
            if isinstance(token, str) and token in knowledge:
                knowing.add(str(path.relative_to(PACKAGE.parent)).removeprefix("checkpoint/"))
    assert knowing <= own, (
        f"{sorted(knowing - own)} name a storage's class or files, but ARCHITECTURE.md's recipe for a checkpoint "
        "storage does not list them among the storages' modules: ask storages.STORAGES there instead"
    )
    assert {f"{s.__module__.rsplit('.', 1)[1]}.py" for s in storages.STORAGES} <= own
    for consumer in ("storages.py", "protocol.py", "state.py", "weights.py"):
        assert consumer in asking, f"the recipe must say that checkpoint/{consumer} asks the list"
    assert "`STORAGES`" in recipe
