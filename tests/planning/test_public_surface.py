"""The planner's public names: changing them is a decision, made here."""

from __future__ import annotations

import multigpu.planning as planning
from multigpu.planning import hardware, models


def test_public_names() -> None:
    assert sorted(planning.__all__) == [
        "Platform",
        "Recommendation",
        "Row",
        "StepTime",
        "Workload",
        "evaluate",
        "gpu_platform",
        "measure_workload",
        "predict_step",
        "recommend",
    ]


def test_presets() -> None:
    assert sorted(models.PRESETS) == ["gpt2-124m", "inception-v3", "resnet101", "resnet50", "vgg16"]
    assert sorted(hardware.GPUS) == [
        "a100-40gb",
        "a100-80gb",
        "h100-80gb",
        "h200-141gb",
        "p100-16gb",
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
