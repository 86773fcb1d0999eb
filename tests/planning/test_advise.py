"""Rows, the recommendation and the JSON plan."""

from __future__ import annotations

import pytest

from multigpu.errors import ConfigError
from multigpu.planning import hardware, workload
from multigpu.planning.advise import Row, evaluate, recommend, to_json
from multigpu.planning.costs import StepTime
from multigpu.planning.hardware import Platform, gpu_platform
from multigpu.planning.workload import Workload
from tests.planning._platforms import two_core_cpu

A100 = gpu_platform(hardware.gpu("a100-80gb"), hardware.link("nvlink-a100"))


def _cpu(contention: float) -> Platform:
    return two_core_cpu(link=hardware.measured_link(0.5e9), contention=contention, synchronous=True)


def test_a_strategy_slower_than_one_device_is_never_recommended() -> None:
    # Two replicas that slow each other 2.2x on two cores: every multi-device row is below single.
    w = Workload(name="mlp", params=2_000_000, compute_s_per_sample=1e-4)
    rows = evaluate(w, _cpu(2.2), [1, 2], global_batch=64)
    single = next(r for r in rows if r.strategy == "single")
    assert all(r.step.throughput < single.step.throughput for r in rows if r.devices == 2)
    rec = recommend(rows)
    assert (rec.strategy, rec.devices) == ("single", 1)
    assert rec.sentence.startswith("Use single device on 1 device:")
    assert rec.sentence.endswith(
        "DataParallel is slower than one device on 2 devices: its host work (replicate, forwards through one GIL) outgrows the work per device."
    )


def test_the_fastest_strategy_wins_where_it_scales() -> None:
    rows = evaluate(workload.from_preset("resnet50", hardware.gpu("a100-80gb")), A100, [1, 2, 4, 8], 32)
    assert (recommend(rows).strategy, recommend(rows).devices) == ("ddp", 8)
    assert "slower than one device" not in recommend(rows).sentence  # 32 images of 224x224 keep a GPU busy


def test_global_batch_is_split_as_dataparallel_splits_it() -> None:
    rows = evaluate(workload.from_preset("resnet50", hardware.gpu("a100-80gb")), A100, [1, 3], global_batch=100)
    assert next(r for r in rows if r.strategy == "single").step.chunks == (100,)
    assert next(r for r in rows if r.strategy == "dp").step.chunks == (34, 33, 33)
    with pytest.raises(ConfigError, match=r"global batch 2 is smaller than 3 devices"):
        evaluate(workload.from_preset("resnet50", hardware.gpu("a100-80gb")), A100, [1, 3], global_batch=2)


def test_chunk_sizes_plan_one_dataparallel_split() -> None:
    rows = evaluate(
        workload.from_preset("gpt2-124m", hardware.gpu("a100-80gb")), A100, [1, 2, 8], chunk_sizes=[4, 19, 19, 18]
    )
    assert sorted({r.devices for r in rows}) == [1, 4]
    by = {r.strategy: r.step.chunks for r in rows}
    assert by["dp"] == (4, 19, 19, 18) and by["ddp"] == (15, 15, 15, 15) and by["single"] == (60,)
    assert sum(by["dp-balanced"]) == 60


def test_exactly_one_batch_is_asked_for() -> None:
    w = workload.from_preset("resnet50", hardware.gpu("a100-80gb"))
    with pytest.raises(
        ConfigError, match=r"pass exactly one of --batch \(per device\), --global-batch and --chunk-sizes"
    ):
        evaluate(w, A100, [1, 2], 32, global_batch=64)
    with pytest.raises(ConfigError, match=r"chunk sizes \[4, 0\] must be >= 1 each"):
        evaluate(w, A100, [1, 2], chunk_sizes=[4, 0])


def test_nothing_fits_says_so_with_the_smallest_peak() -> None:
    t4 = gpu_platform(hardware.gpu("t4"), hardware.link("pcie3"))
    rows = evaluate(workload.from_preset("gpt2-124m", hardware.gpu("t4")), t4, [1, 2], 64)
    rec = recommend(rows, t4.memory_bytes)
    assert rec.strategy == "none" and "Nothing fits: the smallest peak is" in rec.sentence


def test_json_has_exactly_the_documented_schema() -> None:
    rows = evaluate(workload.from_preset("resnet50", hardware.gpu("a100-80gb")), A100, [1, 2], 32)
    plan = to_json(rows, recommend(rows), {"model": "resnet50"})
    assert set(plan) == {"inputs", "rows", "recommendation"}
    for row in plan["rows"]:
        assert set(row) == {
            "strategy",
            "devices",
            "batch_per_device",
            "step_ms",
            "parts_ms",
            "samples_per_s",
            "scaling",
            "peak_bytes",
            "fits",
        }
        assert row["strategy"] in {"single", "dp", "dp-balanced", "ddp", "fsdp"}
        assert len(row["batch_per_device"]) == len(row["peak_bytes"]) == row["devices"]
        assert sum(row["parts_ms"].values()) == pytest.approx(row["step_ms"])  # the parts are the whole step
    assert [(r["strategy"], r["devices"]) for r in plan["rows"]] == [
        ("single", 1),
        ("dp", 2),
        ("dp-balanced", 2),
        ("ddp", 2),
        ("fsdp", 2),
    ]
    assert set(plan["recommendation"]) == {"strategy", "devices", "reason"}


def _row(strategy: str, devices: int, samples_per_s: float, fits: bool = True, peak: float = 1e9) -> Row:
    step = StepTime(strategy, devices, (10,) * devices, 10 * devices / samples_per_s)
    return Row(step, [peak] * devices, fits, samples_per_s / (devices * 100))


def test_fsdp_is_recommended_where_ddp_does_not_fit_and_says_so() -> None:
    rows = [
        _row("single", 1, 100, fits=False, peak=90e9),
        _row("ddp", 4, 390, fits=False, peak=95e9),
        _row("fsdp", 4, 350, peak=30e9),
    ]
    rec = recommend(rows, 80e9)
    assert (rec.strategy, rec.devices) == ("fsdp", 4)
    assert rec.sentence.startswith("Use FSDP on 4 devices:")
    assert "DDP does not fit on 4 devices (peak 88.5 GiB per device); FSDP shards the parameters" in rec.sentence


def test_fsdp_is_never_recommended_where_ddp_fits_and_is_faster_or_as_fast() -> None:
    for fsdp_speed in (300, 390, 395):  # slower, equal, within the 2% the planner cannot resolve
        rows = [_row("single", 1, 100), _row("ddp", 4, 390), _row("fsdp", 4, fsdp_speed)]
        assert recommend(rows).strategy == "ddp", fsdp_speed
    rows = [_row("single", 1, 100), _row("ddp", 4, 390), _row("fsdp", 4, 420)]
    rec = recommend(rows)
    assert rec.strategy == "fsdp" and "FSDP is predicted faster than DDP here (390 samples/s)" in rec.sentence


def test_fsdp_slower_than_one_device_is_never_recommended() -> None:
    rows = [_row("single", 1, 100), _row("ddp", 2, 90, fits=False), _row("fsdp", 2, 95)]
    assert recommend(rows).strategy == "single"


def test_a_model_too_large_for_ddp_gets_fsdp_from_evaluate() -> None:
    # 6 B parameters with Adam: 96 GB of state, 120 GB with DDP's bucket; FSDP on 8 holds 12 GB of shards.
    w = Workload(name="big", params=6_000_000_000, compute_s_per_sample=1e-2)
    rows = evaluate(w, A100, [1, 2, 8], 1)
    fits = {(r.strategy, r.devices): r.fits for r in rows}
    assert not fits[("ddp", 8)] and not fits[("single", 1)] and fits[("fsdp", 8)]
    rec = recommend(rows, A100.memory_bytes)
    assert (rec.strategy, rec.devices) == ("fsdp", 8) and "DDP does not fit on 8 devices" in rec.sentence
