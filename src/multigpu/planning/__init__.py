"""Predict: per-step time and per-device memory of each strategy, and which to use.

Modules: hardware (GPU and link presets with sources), workload (what is trained), counting (one
step counted on the meta device, fsdp's groups), host (the host's share: Python, dispatch, launches, the GIL),
calibrate (the host constants, measured), models (built-in presets), factory (a user's model by
import path), platform (devices + links), costs (time), memory (bytes per device), measure
(timings on this CPU), cases (published results), advise (the answer), table (the answer, printed).
The equations: docs/planning.md.

Example:
    >>> from multigpu.planning import evaluate, gpu_platform, recommend
    >>> from multigpu.planning import hardware, models
    >>> gpu = hardware.gpu("v100-32gb")
    >>> rows = evaluate(models.workload("resnet50", gpu), gpu_platform(gpu, hardware.link("nvlink-v100")), [1, 8], 32)
    >>> recommend(rows).strategy
    'ddp'
"""

from multigpu.planning.advise import Recommendation, Row, evaluate, recommend, to_json
from multigpu.planning.calibrate import measure_host_costs
from multigpu.planning.costs import StepTime, predict_step
from multigpu.planning.counting import count_step
from multigpu.planning.host import HostCosts
from multigpu.planning.measure import measure_workload
from multigpu.planning.platform import Platform, gpu_platform
from multigpu.planning.workload import FsdpLayout, StepCounts, Workload

__all__ = [
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
