"""Every ``multigpu`` command builds the whole parser first: building it must stay cheap."""

from __future__ import annotations

import sys

import pytest

from tests.launching import run_command


@pytest.mark.multiprocess
def test_building_the_cli_imports_no_plotting_library() -> None:
    """pyplot is imported by the first figure, not by ``multigpu launch --help`` (it costs ~0.3 s)."""
    probe = "import sys; from multigpu.cli.main import build_parser; build_parser(); print(sorted(m for m in sys.modules if m.startswith('matplotlib')))"
    done = run_command([sys.executable, "-c", probe], timeout_s=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
