"""The GPU check's CPU-side parts: step selection, the time budget, the report, the probes' plumbing.

What only a GPU shows (the figures themselves) runs with ``./scripts/gpu-check`` on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the steps name scripts/ and examples/ relative to the repository


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_refuses_unless_asked_for_a_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_an_unknown_step_is_named_with_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--allow-cpu", "--only", "demo,warp-drive", "--out", str(tmp_path)]) == 2
    said = capsys.readouterr().out
    assert "warp-drive" in said and "dp-overhead" in said


@pytest.mark.multiprocess
def test_probes_run_and_their_figures_reach_the_report(tmp_path: Path) -> None:
    assert gpu_check.main(["--allow-cpu", "--only", "dp-overhead,copies", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert set(steps) == {"dp-overhead", "copies"}
    overhead = steps["dp-overhead"]["result"]
    assert overhead["cpu_batch_into_model"] is True
    assert overhead["bare_ms"] > 0 and overhead["ratio"] > 0
    assert steps["copies"]["result"]["device_to_device_GBps"] > 0
    table = (tmp_path / "report.md").read_text()
    assert "| dp-overhead | passed |" in table and "ratio=" in table


def test_a_spent_budget_skips_the_remaining_steps_and_fails_the_check(tmp_path: Path) -> None:
    assert gpu_check.main(["--allow-cpu", "--only", "env,copies", "--budget", "0", "--out", str(tmp_path)]) == 1
    statuses = [s["status"] for s in json.loads((tmp_path / "report.json").read_text())["steps"]]
    assert statuses == ["skipped", "skipped"]


@pytest.mark.multiprocess
def test_a_step_that_overruns_its_limit_is_stopped_and_reported(tmp_path: Path) -> None:
    step = gpu_check.Step("sleep", [sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=1.5)
    outcome = gpu_check.run_step(step, tmp_path, budget_s=60)
    assert outcome.status.startswith("timed out") and outcome.seconds < 20  # stopped, not the 30 s sleep
