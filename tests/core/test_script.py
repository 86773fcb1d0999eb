"""Running a file as ``__main__``: what the script sees, and what is put back after it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from multigpu.core.script import run_as_main

SCRIPT = """
import json, sys
from pathlib import Path
import helper  # a module next to the script: its folder is first on sys.path
Path(sys.argv[1]).write_text(json.dumps({"name": __name__, "argv": sys.argv[2:], "helper": helper.VALUE}))
if "--fail" in sys.argv:
    sys.exit(3)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_the_script_runs_as_main_with_its_arguments_and_folder(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    argv, path = list(sys.argv), list(sys.path)
    run_as_main(script, [str(out), "--lr", "0.1"])
    assert json.loads(out.read_text()) == {"name": "__main__", "argv": ["--lr", "0.1"], "helper": 42}
    assert sys.argv == argv and sys.path == path  # put back


def test_its_exit_reaches_the_caller_and_the_state_is_still_restored(script: Path, tmp_path: Path) -> None:
    argv = list(sys.argv)
    with pytest.raises(SystemExit) as exited:
        run_as_main(script, [str(tmp_path / "seen.json"), "--fail"])
    assert exited.value.code == 3 and sys.argv == argv
