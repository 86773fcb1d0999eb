"""`multigpu advise --measure` end to end on this CPU: a factory and a Session script, one strategy failing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.launching import run_command

TINY = "tests.planning._tiny_model"


def _advise(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> dict:
    done = run_command(
        [sys.executable, "-m", "multigpu", "advise", "--measure", *argv, "--json", "--out", str(tmp_path)],
        timeout_s=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_factory_is_measured_beside_its_prediction_and_a_failing_strategy_does_not_stop_the_others(
    tmp_path: Path,
) -> None:
    from multigpu.planning import machine
    from tests.planning.machine_constants import fill

    cache = fill(tmp_path / "cache")
    plan = _advise(
        tmp_path,
        *("--model", f"{TINY}:fails_in_processes", "--input-shape", "32", "--batch", "16"),
        *("--strategies", "single,ddp", "--budget", "90"),
        env={"MULTIGPU_CACHE_DIR": str(cache.parent)},
    )
    rows = {r["strategy"]: r for r in plan["measured"]["rows"]}
    assert set(rows) == {"single", "ddp"}
    single, ddp = rows["single"], rows["ddp"]
    assert single["status"] == "ok" and single["steps"] >= 1 and single["step_ms"] > 0
    assert single["samples_per_s"] == pytest.approx(16 / (single["step_ms"] / 1e3))
    assert single["predicted_step_ms"] > 0 and single["step_error"] == pytest.approx(
        single["predicted_step_ms"] / single["step_ms"] - 1
    )
    assert single["peak_bytes"][0] > 0 and single["memory_source"] == "allocation tracker"
    assert ddp["status"] == "failed" and "refuses to run in a process group" in ddp["reason"]
    assert plan["measured"]["recommendation"]["strategy"] == "single"
    assert {r["strategy"] for r in plan["rows"]} >= {"single", "ddp"}  # the prediction is there too
    assert json.loads((tmp_path / "advise.json").read_text())["measured"] == plan["measured"]
    assert (tmp_path / "advise-measured.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # what ran solved its own constant, fed back into this machine's cache unless the machine was loaded
    # (then refused, with why: tests/planning/test_machine.py checks the rule); the failed ddp solved nothing
    fed = plan["measured"]["fed_back"]
    assert set(fed["constants"]) | set(fed["refused"]) == {"compute_scale"}
    kept = machine.load(cache.parent, machine.machine_key())
    assert kept is not None
    if fed["constants"]:
        assert fed["file"] == str(cache) and kept.feedback == {"compute_scale": [fed["constants"]["compute_scale"]]}
    else:
        assert fed["file"].startswith("not written") and kept.feedback == {}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_session_script_is_timed_by_its_optimizer_steps_under_each_strategy(tmp_path: Path) -> None:
    plan = _advise(
        tmp_path,
        *("--script", "tests/planning/_session_script.py", "--script-args", "--batch 8"),
        *("--strategies", "single,dp", "--budget", "90"),
    )
    assert plan["rows"] == [] and plan["recommendation"] is None  # no factory: nothing to predict
    rows = {r["strategy"]: r for r in plan["measured"]["rows"]}
    for name in ("single", "dp"):
        row = rows[name]
        assert row["status"] == "ok", row["reason"]
        # samples counted on the outermost forward: the global batch of 8, whatever dp splits
        assert row["samples_per_s"] * row["step_ms"] / 1e3 == pytest.approx(8)
        assert row["predicted_step_ms"] is None and row["step_error"] is None
    assert plan["measured"]["recommendation"]["strategy"] in ("single", "dp")


def test_measure_needs_a_factory_or_a_script_and_names_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    from multigpu.cli.main import main

    assert main(["advise", "--measure", "--model", "resnet50", "--gpu", "a100-80gb", "--link", "nvlink-a100"]) == 2
    assert "--model package.module:factory) or a script (--script)" in capsys.readouterr().out
    assert main(["advise", "--measure", "--model", f"{TINY}:build", "--input-shape", "32", "--strategies", "tp"]) == 2
    assert "--strategies 'tp': pick from single, dp, ddp, fsdp" in capsys.readouterr().out
    assert main(["advise", "--script", "train.py"]) == 2
    assert "--script needs --measure" in capsys.readouterr().out
