"""Predict: per-step time and per-device memory of each strategy, and which to use.

Modules: hardware (what a step runs on: GPU and link presets with sources, the host's costs, the
platform), workload (what is trained: the workload and model presets), counting (one step counted
on the meta device or timed on this CPU, fsdp's groups; left_as_found puts a real model back), calibrate
(this machine measured: host costs, what CPU replicas share, collectives), step_floors (what an engine adds
to every step, timed through it on a tiny model: DataParallel's hand-off, DDP's step), machine (this machine's constants for a CPU plan,
cached, and what ``advise --measure`` feeds back), cpu_plan (a model timed as each strategy runs it
here), timing (the low-quantile rule), costs (time per strategy, the planned rows: each names a strategy of multigpu.strategies),
memory (bytes per device), advise (the answer: recommendation, JSON, table rows, figure),
measured (``advise --measure``'s runs beside their predictions; the launcher starts the runs).
The equations: docs/planning.md; the published cases they are checked against: tests/planning.

Example:
    >>> from multigpu.planning import evaluate, gpu_platform, recommend
    >>> from multigpu.planning import hardware, workload
    >>> gpu = hardware.gpu("v100-32gb")
    >>> rows = evaluate(workload.from_preset("resnet50", gpu), gpu_platform(gpu, hardware.link("nvlink-v100")), [1, 8], 32)
    >>> recommend(rows).strategy
    'ddp'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from multigpu.planning.advise import Recommendation, Row, evaluate, recommend, to_json
    from multigpu.planning.calibrate import measure_host_costs
    from multigpu.planning.costs import StepTime, predict_step
    from multigpu.planning.counting import count_step, measure_workload
    from multigpu.planning.hardware import HostCosts, Platform, gpu_platform
    from multigpu.planning.workload import FsdpLayout, StepCounts, Workload

# The names are imported on first use: `multigpu advise --help` reads the presets in
# planning.hardware/workload without paying for torch, which counting and measuring import.
_SOURCES = {
    **dict.fromkeys(("Recommendation", "Row", "evaluate", "recommend", "to_json"), "advise"),
    "measure_host_costs": "calibrate",
    **dict.fromkeys(("StepTime", "predict_step"), "costs"),
    **dict.fromkeys(("count_step", "measure_workload"), "counting"),
    **dict.fromkeys(("HostCosts", "Platform", "gpu_platform"), "hardware"),
    **dict.fromkeys(("FsdpLayout", "StepCounts", "Workload"), "workload"),
}

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


def _import_on_first_use(name: str) -> Any:
    """Import a public name from its module on first use (PEP 562), then keep it."""
    if name not in _SOURCES:
        raise AttributeError(f"module 'multigpu.planning' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"multigpu.planning.{_SOURCES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if not TYPE_CHECKING:  # hidden from type checkers, which see the imports above: a misspelt name stays an error there
    __getattr__ = _import_on_first_use
