"""Predict: per-step time and per-device memory of each strategy, and which to use.

Modules: hardware (GPU and link presets with sources), workload (what is trained), models
(built-in presets), platform (devices + links), costs (time), memory (bytes per device),
measure (one-device measurement), cases (published end-to-end results), advise (the answer).
The equations: docs/planning.md.

Example:
    >>> from multigpu.planning import evaluate, gpu_platform, recommend
    >>> from multigpu.planning import hardware, models
    >>> gpu = hardware.gpu("v100-32gb")
    >>> rows = evaluate(models.workload("resnet50", gpu), gpu_platform(gpu, hardware.link("nvlink-v100")), [1, 8], 32)
    >>> recommend(rows).strategy
    'ddp'
"""

from multigpu.planning.advise import Recommendation, Row, evaluate, recommend
from multigpu.planning.costs import StepTime, predict_step
from multigpu.planning.measure import measure_workload
from multigpu.planning.platform import Platform, gpu_platform
from multigpu.planning.workload import Workload

__all__ = [
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
