"""Every ``multigpu`` command builds the whole parser first: building it must stay cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.multiprocess
def test_building_the_cli_imports_no_plotting_library() -> None:
    """pyplot is imported by the first figure, not by ``multigpu launch --help`` (it costs ~0.3 s)."""
    probe = "import sys; from multigpu.cli.main import build_parser; build_parser(); print(sorted(m for m in sys.modules if m.startswith('matplotlib')))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stdout
