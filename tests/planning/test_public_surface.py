"""The planner's public names: changing them is a decision, made here."""

from __future__ import annotations

import multigpu.planning as planning
from multigpu.planning import hardware, workload


def test_public_names() -> None:
    assert sorted(planning.__all__) == [
        "FsdpLayout",
        "HostCosts",
        "Platform",
        "Recommendation",
        "Row",
        "StepCounts",
        "StepTime",
        "Workload",
        "count_step",
        "evaluate",
        "gpu_platform",
        "measure_host_costs",
        "measure_workload",
        "predict_step",
        "recommend",
        "to_json",
    ]
    assert all(hasattr(planning, name) for name in planning.__all__)  # imported on first use


def test_presets() -> None:
    assert sorted(workload.PRESETS) == ["gpt2-124m", "inception-v3", "resnet101", "resnet50", "vgg16"]
    assert sorted(hardware.GPUS) == [
        "a10",
        "a100-40gb",
        "a100-80gb",
        "gtx-1080-ti",
        "h100-80gb",
        "h200-141gb",
        "l4",
        "l40s",
        "p100-16gb",
        "rtx-2080-ti",
        "rtx-3090",
        "rtx-4090",
        "rtx-a6000",
        "t4",
        "titan-rtx",
        "v100-16gb",
        "v100-32gb",
    ]
    assert sorted(hardware.LINKS) == [
        "ib-hdr",
        "ib-ndr",
        "nvlink-a100",
        "nvlink-h100",
        "nvlink-titan-rtx",
        "nvlink-v100",
        "pcie3",
        "pcie3-nop2p",
        "pcie4",
        "pcie5",
        "roce-25g",
    ]
