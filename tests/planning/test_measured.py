"""The measured rows beside the predicted ones: errors, the recommendation from measurement, JSON and table."""

from __future__ import annotations

import pytest
from rich.console import Console

from multigpu.planning.advise import evaluate
from multigpu.planning.hardware import gpu, gpu_platform, link
from multigpu.planning.measured import (
    Measurement,
    check,
    measured_json,
    measured_rows,
    print_measured,
    recommend_measured,
)
from multigpu.planning.workload import from_preset


def _ok(strategy: str, devices: int, step_ms: float, samples: int = 64) -> Measurement:
    return Measurement(
        strategy=strategy,
        devices=devices,
        step_s=step_ms / 1e3,
        samples_per_step=samples,
        steps=5,
        peak_bytes=[2**20] * devices,
        memory_source="allocation tracker",
    )


def _rows() -> list:
    g = gpu("v100-32gb")
    return evaluate(from_preset("resnet50", g), gpu_platform(g, link("nvlink-v100")), [1, 2], 32)


def test_each_measurement_meets_its_prediction_and_the_error_is_predicted_over_measured() -> None:
    rows = _rows()
    single = next(r for r in rows if r.strategy == "single")
    checked = check(rows, [_ok("single", 1, single.step.total_s * 1e3 / 2, 32), _ok("ddp", 2, 50.0)])
    assert checked[0].predicted is single
    assert checked[0].time_error == pytest.approx(1.0)  # predicted twice the measured step
    assert checked[0].memory_error == pytest.approx(max(single.memory) / 2**20 - 1)
    assert checked[1].predicted is not None and checked[1].predicted.strategy == "ddp"


def test_the_fastest_measured_strategy_is_recommended_and_a_failure_never_is() -> None:
    failed = Measurement(strategy="fsdp", devices=2, status="out of memory", reason="CUDA out of memory (exit 1)")
    rec = recommend_measured(check([], [_ok("single", 1, 20.0, 32), _ok("ddp", 2, 12.0), failed]))
    assert (rec.strategy, rec.devices) == ("ddp", 2)
    assert "3.33x slower" in rec.sentence and "fsdp x2 (out of memory)" in rec.sentence


def test_within_two_percent_fewer_devices_win_then_ddp_over_fsdp() -> None:
    assert recommend_measured(check([], [_ok("single", 1, 10.0, 64), _ok("dp", 2, 9.9)])).strategy == "single"
    assert recommend_measured(check([], [_ok("fsdp", 2, 10.0), _ok("ddp", 2, 10.1)])).strategy == "ddp"


def test_nothing_ran_says_why_and_what_to_change() -> None:
    timed_out = Measurement(strategy="single", devices=1, status="timed out", reason="did not finish")
    rec = recommend_measured(check([], [timed_out]))
    assert rec.strategy == "none"
    assert "single x1: timed out" in rec.sentence and "--budget" in rec.sentence


def test_table_and_json_show_failures_with_their_reason() -> None:
    failed = Measurement(strategy="ddp", devices=2, status="failed", reason="RuntimeError: boom (exit 1)")
    checked = check(_rows(), [_ok("single", 1, 20.0, 32), failed])
    rec = recommend_measured(checked)
    columns, rows = measured_rows(checked)
    assert columns[:5] == ["strategy", "N", "step ms", "pred ms", "error"]
    assert rows[0][2] == "20.0" and rows[1][-1] == "FAILED"
    data = measured_json(checked, rec, 30.0)
    assert data["rows"][1]["status"] == "failed" and data["rows"][1]["step_ms"] is None
    assert data["rows"][0]["step_error"] == pytest.approx(checked[0].time_error)
    console = Console(record=True, width=120)
    print_measured(console, checked, rec, 30.0)
    text = console.export_text()
    assert "ddp x2: RuntimeError: boom (exit 1)" in text and "Measured here: use single device" in text


def test_the_figure_sets_measured_beside_predicted_throughput(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from multigpu.planning.measured import plot_measured

    failed = Measurement(strategy="ddp", devices=2, status="timed out", reason="budget")
    path = plot_measured(check(_rows(), [_ok("single", 1, 20.0, 32), failed]), tmp_path / "m.png", "tiny")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
