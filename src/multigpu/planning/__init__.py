"""Predict: per-step time and per-device memory of each strategy, and which to use.

Modules: hardware (GPU and link presets with sources), workload (what is trained), models
(built-in presets), platform (devices + links), costs (time), memory (bytes per device),
measure (one-device measurement), cases (published end-to-end results), advise (the answer).
"""

from multigpu.planning.costs import StepTime, predict_step
from multigpu.planning.platform import Platform, gpu_platform
from multigpu.planning.workload import Workload

__all__ = ["Platform", "StepTime", "Workload", "gpu_platform", "predict_step"]
