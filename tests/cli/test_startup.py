"""Every ``multigpu`` command builds the whole parser first: building it must stay cheap.

Cheap means: neither torch (~2 s to import here) nor the library behind the commands is imported
before a command runs, so ``multigpu --help``, ``multigpu COMMAND --help`` and ``--version`` answer
at once. The tests check what is imported, never how long it took (the cores are shared).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from typing import Any

import pytest

from multigpu.cli.main import main, subcommands
from tests.launching import run_command

_HEAVY = ("torch", "numpy", "matplotlib", "rich", "multigpu.parallel", "multigpu.checkpoint", "multigpu.devices")


def _imported_by(code: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after running ``code``."""
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(m for m in {_HEAVY!r} if m in sys.modules)))"
    done = run_command([sys.executable, "-c", probe], timeout_s=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return list(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.multiprocess
def test_building_the_cli_imports_no_plotting_library() -> None:
    """pyplot is imported by the first figure, not by ``multigpu launch --help`` (it costs ~0.3 s)."""
    probe = "import sys; from multigpu.cli.main import build_parser; build_parser(); print(sorted(m for m in sys.modules if m.startswith('matplotlib')))"
    done = run_command([sys.executable, "-c", probe], timeout_s=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.multiprocess
def test_help_of_the_command_imports_no_torch() -> None:
    """The real entry point, as a user runs it: ``python -X importtime -m multigpu --help``."""
    done = run_command([sys.executable, "-X", "importtime", "-m", "multigpu", "--help"], timeout_s=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: multigpu" in done.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "multigpu.cli.main" in imported  # the probe sees our imports at all
    assert not {name for name in imported if name == "torch" or name.startswith("torch.")}


@pytest.mark.multiprocess
def test_help_of_every_subcommand_imports_nothing_heavy() -> None:
    code = (
        "import contextlib, io\n"
        "from multigpu.cli.main import main, subcommands\n"
        "for name in subcommands():\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main([name, '--help'])\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--version'])"
    )
    assert _imported_by(code) == []


@pytest.mark.multiprocess
def test_importing_the_package_imports_nothing_heavy_until_a_name_is_used() -> None:
    assert _imported_by("import multigpu; dir(multigpu); multigpu.ConfigError") == []
    assert "torch" in _imported_by("import multigpu; multigpu.DataParallel")


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"multigpu {importlib.metadata.version('multigpu')}\n"


def _choices(command: Any, dest: str) -> Any:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return next(a.choices for a in parser._actions if a.dest == dest)


def test_choices_written_in_the_cli_match_the_library() -> None:
    """The parser spells out a few of the library's constants so that it need not import it."""
    from multigpu.checkpoint.formats import DEFAULT_MAX_EXPANSION, FORMATS
    from multigpu.cli import bandwidth, ckpt, demo, launch
    from multigpu.demo.train import DTYPES, TrainConfig
    from multigpu.devices import device_type_names, get_device_type
    from multigpu.launcher.config import LAUNCH_STRATEGIES, RDZV_BACKENDS

    assert launch.LAUNCH_STRATEGIES == LAUNCH_STRATEGIES
    assert _choices(launch, "rdzv_backend") == RDZV_BACKENDS
    assert _choices(demo, "dtype") == DTYPES
    kinds = (get_device_type(name) for name in device_type_names())
    assert set(_choices(bandwidth, "backend")) == {kind.backend for kind in kinds}  # the built-in types' backends
    assert ckpt.FORMATS == FORMATS
    assert ckpt.DEFAULT_MAX_EXPANSION == DEFAULT_MAX_EXPANSION
    defaults = TrainConfig()
    assert {name: getattr(defaults, name) for name in demo._DEFAULTS} == demo._DEFAULTS
    assert set(subcommands()) >= {"ckpt", "demo", "launch"}
