from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.checkpoint.formats import detect_format, read_tensors
from multigpu.checkpoint.torch_file import load_torch_file
from multigpu.cli.main import main
from multigpu.errors import CheckpointError, ConfigError


def _dp_file(tmp_path: Path) -> tuple[Path, nn.Module]:
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    torch.save(nn.DataParallel(net).state_dict(), tmp_path / "dp.pt")
    return tmp_path / "dp.pt", net


def test_inspect_shows_keys_shapes_format_and_prefixes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = _dp_file(tmp_path)
    assert main(["ckpt", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "module. (4 keys)" in out
    assert "module.0.weight" in out and "[3, 4]" in out and "float32" in out
    assert "4 (92 B)" in out  # 12 + 3 + 6 + 2 floats


def test_inspect_a_checkpointer_folder_shows_its_latest_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "500")  # the path is folded at the terminal's width, and tmp paths are long
    model = nn.Linear(3, 2)
    checkpointer = ckpt.Checkpointer(folder=tmp_path)
    for step in (5, 9):
        checkpointer.save(step=step, model=model, epoch=2, data_position={"batch": 4})
    assert main(["ckpt", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step-00000009" in out and "safetensors" in out
    assert "saved step        9" in out and "{'batch': 4}" in out and "none" in out


def test_convert_torch_to_safetensors_strips_prefixes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, net = _dp_file(tmp_path)
    out = tmp_path / "clean.safetensors"
    assert main(["ckpt", "convert", str(path), str(out)]) == 0
    assert detect_format(out) == "safetensors"
    assert sorted(read_tensors(out)[0]) == sorted(net.state_dict())
    back = tmp_path / "back.bin"
    assert main(["ckpt", "convert", str(out), str(back), "--to", "torch"]) == 0
    loaded = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    loaded.load_state_dict(torch.load(back, weights_only=True))  # plain torch reads it
    assert torch.equal(loaded[0].weight, net[0].weight)
    assert "wrote 4 tensors" in capsys.readouterr().out


def test_convert_strips_an_extra_prefix(tmp_path: Path) -> None:
    ckpt.save({"model.fc.weight": torch.ones(2)}, tmp_path / "a.safetensors")
    assert (
        main(["ckpt", "convert", str(tmp_path / "a.safetensors"), str(tmp_path / "b.pt"), "--strip-prefix", "model."])
        == 0
    )
    assert list(read_tensors(tmp_path / "b.pt")[0]) == ["fc.weight"]


def test_a_prefix_is_a_module_path_in_convert_and_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 'model' wrote keys '.weight'/'.bias'; load(strip="model.") stripped the letters 'm', 'o', ... one by one;
    # strip=(None,) or 5 raised TypeError
    source = ckpt.save({"model.weight": torch.ones(2, 2), "model.bias": torch.ones(2)}, tmp_path / "a.safetensors")
    assert main(["ckpt", "convert", str(source), str(tmp_path / "b.pt"), "--strip-prefix", "model"]) == 0
    assert sorted(read_tensors(tmp_path / "b.pt")[0]) == ["bias", "weight"]
    for strip in ("model.", "model", ["model"], ("model.",)):
        ckpt.load(nn.Linear(2, 2), source, strip=strip)
    for strip, named in (((None,), "None"), (5, "5"), (("",), "''"), (".", "'.'")):
        with pytest.raises(ConfigError, match=rf"strip holds {re.escape(named)}; .* e\.g\. strip=\('model\.',\)"):
            ckpt.load(nn.Linear(2, 2), source, strip=strip)  # type: ignore[arg-type]
    capsys.readouterr()
    assert main(["ckpt", "convert", str(source), str(tmp_path / "c.pt"), "--strip-prefix", ""]) == 1
    assert "--strip-prefix holds ''; give key prefixes as strings naming a module path, e.g. --strip-prefix model." in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "c.pt").exists()


class _Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("code ran",))


def test_unsafe_files_are_refused_with_the_flag_to_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"w": torch.ones(1), "x": _Evil()}, tmp_path / "evil.pt")
    assert main(["ckpt", "inspect", str(tmp_path / "evil.pt")]) == 1
    captured = capsys.readouterr()
    assert "needs arbitrary unpickling" in captured.err and "--allow-unsafe-pickle" in captured.err
    assert "code ran" not in captured.out


_MODULE = "polish_vanished_models"  # a module name nothing else uses


@pytest.fixture()
def saved_with_a_class(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A torch file whose pickle needs ``polish_vanished_models.Config``, saved from a project folder
    that is then off ``sys.path`` and out of ``sys.modules``, as in a fresh process elsewhere."""
    project = tmp_path / "project"
    project.mkdir()
    (project / f"{_MODULE}.py").write_text("class Config:\n    def __init__(self):\n        self.lr = 0.1\n")
    sys.path.insert(0, str(project))
    try:
        config = importlib.import_module(_MODULE).Config()
        path = tmp_path / "run.pt"
        torch.save({"state_dict": {"fc.weight": torch.ones(2, 3)}, "config": config}, path)
    finally:
        sys.path.remove(str(project))
        sys.modules.pop(_MODULE, None)
    yield path, project
    sys.modules.pop(_MODULE, None)
    assert str(project) not in sys.path  # nothing was left on the import path


def test_a_class_that_cannot_be_imported_is_named_with_the_fix(
    saved_with_a_class: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = saved_with_a_class
    monkeypatch.chdir(path.parent)  # not the project folder: the module is nowhere to be found
    assert main(["ckpt", "inspect", str(path), "--allow-unsafe-pickle"]) == 1
    err = capsys.readouterr().err
    assert f"its pickle needs {_MODULE}.Config, which cannot be imported here (No module named '{_MODULE}')" in err
    assert "PYTHONPATH" in err and "Traceback" not in err
    with pytest.raises(CheckpointError, match=rf"needs {_MODULE}\.Config.*from your project's folder.*PYTHONPATH"):
        load_torch_file(path, allow_unsafe_pickle=True)


def test_a_class_gone_from_its_module_is_named(saved_with_a_class: tuple[Path, Path]) -> None:
    path, project = saved_with_a_class
    (project / f"{_MODULE}.py").write_text("class Settings:\n    pass\n")  # Config renamed since the save
    sys.path.insert(0, str(project))
    try:
        with pytest.raises(CheckpointError, match=rf"needs {_MODULE}\.Config.*Can't get attribute 'Config'"):
            load_torch_file(path, allow_unsafe_pickle=True)
    finally:
        sys.path.remove(str(project))


def test_unsafe_inspect_finds_classes_in_the_current_folder(
    saved_with_a_class: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``python script.py`` run from the project folder would (a console script's path starts elsewhere)."""
    path, project = saved_with_a_class
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(project))])
    assert main(["ckpt", "inspect", str(path), "--allow-unsafe-pickle"]) == 0
    assert "fc.weight" in capsys.readouterr().out


def test_a_folder_without_checkpoints_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ckpt", "inspect", str(tmp_path)]) == 1
    assert "holds no checkpoint" in capsys.readouterr().err


def test_public_surface_is_a_decision() -> None:
    assert sorted(ckpt.__all__) == sorted(
        [
            "WRAPPER_PREFIXES",
            "Checkpointer",
            "Resumed",
            "clean_state_dict",
            "find_latest",
            "find_prefixes",
            "load",
            "save",
            "strip_prefixes",
            "unwrap",
        ]
    )
    from multigpu.cli import ckpt as command
    from multigpu.cli.main import build_parser

    parser = build_parser()
    assert command.HELP
    flags = {
        action: sorted(o for a in sub._actions for o in a.option_strings)
        for action, sub in _subparsers(_subparsers(parser)["ckpt"]).items()
    }
    assert flags == {
        "inspect": sorted(["--allow-unsafe-pickle", "--max-keys", "-h", "--help"]),
        "convert": sorted(
            ["--to", "--keep-prefixes", "--strip-prefix", "--max-expansion", "--allow-unsafe-pickle", "-h", "--help"]
        ),
    }


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_names_from_a_file_are_shown_not_interpreted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Rich markup and terminal control characters in keys must neither crash nor style the output.
    keys = ["[/bold]", "[red]x", "esc\x1b[31mape", "rs\x1erecord"]
    ckpt.save({k: torch.ones(1) for k in keys}, tmp_path / "w.safetensors")
    assert main(["ckpt", "inspect", str(tmp_path / "w.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "[/bold]" in out and "[red]x" in out and "esc\\x1b[31mape" in out and "\x1b[31m" not in out


def test_an_error_naming_odd_globals_stays_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.checkpoint import _craft

    pickle_bytes = b"\x80\x02ctorch\nFloatSt\x1erage\n)R."
    (tmp_path / "w.pt").write_bytes(_craft.doctored_torch({}, _craft.with_pickle(pickle_bytes)))
    assert main(["ckpt", "inspect", str(tmp_path / "w.pt")]) == 1
    err = capsys.readouterr().err
    assert "torch.FloatSt\\x1erage" in err and len(err.strip().splitlines()) == 1
