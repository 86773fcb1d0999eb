"""The published end-to-end cases, predicted from their setups (tests/planning/_published_cases.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from multigpu.planning import hardware
from tests.planning import _published_cases as cases


@pytest.mark.parametrize("overlap", [0.0, 0.2, 0.5, 0.75])
def test_the_faster_strategy_is_named_correctly_in_every_case(overlap: float) -> None:
    # Not tuned to one overlap value: every case holds over the whole range.
    rows = cases.all_cases(overlap)
    assert len(rows) == 2 + 8 + 3 + 3
    wrong = [(r.case, r.quantity) for r in rows if r.faster_predicted != r.faster_published]
    assert not wrong


def test_hf_gpt2_ddp_over_dp_ratio_within_20_percent() -> None:
    with_nvlink, without = cases.hf_gpt2_dp_vs_ddp()
    assert with_nvlink.published == pytest.approx(101.90 / 110.59)
    assert without.published == pytest.approx(131.44 / 110.59)
    for row in (with_nvlink, without):
        assert 0.8 <= row.ratio <= 1.2, row
    assert with_nvlink.faster_predicted == "ddp"  # DP ~10% slower than DDP with NVLink
    assert without.faster_predicted == "dp"  # DP ~15% faster than DDP without it


def test_pytorch_ddp_benchmark_iteration_times_within_10_percent() -> None:
    for row in cases.pytorch_ddp_benchmark():
        assert 0.9 <= row.ratio <= 1.1, row


def test_vertex_t4_dp_and_ddp_speedups_within_20_percent() -> None:
    ratio, dp_speedup, ddp_speedup = cases.vertex_resnet50_t4()
    assert ratio.faster_predicted == "ddp"
    for row in (ratio, dp_speedup, ddp_speedup):
        assert 0.8 <= row.ratio <= 1.2, row


def test_horovod_vgg16_scales_worst() -> None:
    inception, resnet101, vgg16 = cases.horovod_scaling()
    assert vgg16.predicted < min(inception.predicted, resnet101.predicted)
    for row in (inception, resnet101):
        assert abs(row.predicted - row.published) <= 0.05, row


@pytest.mark.parametrize("host_scale", [0.5, 1.0, 2.0])
def test_dataparallel_regimes_of_public_reports(host_scale: float) -> None:
    # No per-case factor: the same constants as every other case (host costs measured, launch cited),
    # and the regimes hold for a server host twice as fast or twice as slow as the one measured.
    h = hardware.DEFAULT_HOST
    scaled = replace(
        h,
        op_s=h.op_s * host_scale,
        module_call_s=h.module_call_s * host_scale,
        backward_op_s=h.backward_op_s * host_scale,
        replicate_module_s=h.replicate_module_s * host_scale,
        replicate_tensor_s=h.replicate_tensor_s * host_scale,
    )
    eight, two, four = cases.dataparallel_regimes(scaled)
    assert eight.predicted >= 2.0, eight  # DP at least 2x slower than DDP, ResNet-50 on 8 A100s
    assert eight.faster_predicted == "ddp"
    for row in (two, four):  # ResNet-50 at 32x32, 256 per GPU: DataParallel below one GPU
        assert row.predicted < 1.0, row
        assert row.faster_predicted == row.faster_published == "single"
