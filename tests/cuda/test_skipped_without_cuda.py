"""Every test marked ``cuda`` is collected, and skipped for want of a GPU, on a machine without one.

Not marked ``cuda`` itself: it runs in the CPU suite. ``./scripts/gpu-check`` runs the marked tests on a
GPU; everywhere else their modules must still import (a broken import would only show on the GPU
machine, too late) and every one of them must skip with the reason the conftest gives, never start.
The child pytest sees no GPU (``CUDA_VISIBLE_DEVICES`` empty), so this holds on a GPU machine too.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.launching import ROOT, run_command

REASON = "needs a CUDA device"


@pytest.mark.multiprocess
def test_every_cuda_test_is_collected_and_skipped_without_a_gpu(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    # Only the modules that mark tests: importing the whole suite would double this test's time.
    marking = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text()
    )
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    done = run_command([*argv, *marking], env={"CUDA_VISIBLE_DEVICES": ""}, timeout_s=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]  # 2: a module failed to import
    cases = list(ET.parse(report).getroot().iter("testcase"))
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        assert case.find("error") is None and case.find("failure") is None, name
        skipped = case.find("skipped")
        assert skipped is not None and skipped.get("message", "").startswith(REASON), name
    modules = {case.get("classname") for case in cases}
    here = Path(__file__)
    ours = {f"tests.cuda.{p.stem}" for p in here.parent.glob("test_*.py") if p != here}
    assert ours and ours <= modules, sorted(ours - modules)  # every module of this folder took part
    assert len(cases) >= 30
