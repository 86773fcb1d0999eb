"""One training-loop API for every strategy (single / dp / ddp / fsdp), precision and accumulation.

- :mod:`~multigpu.session.session`: :class:`Session`, the loop's one handle (model, data, step, log, evaluate);
- :mod:`~multigpu.session.config`: :class:`SessionConfig`, what it is built from;
- :mod:`~multigpu.session.toolkit`, :mod:`~multigpu.session.coordination`: the loop toolkit (gather,
  broadcast, gather_for_metrics, split_between_processes, main_process_first, triggers, join);
- :mod:`~multigpu.session.evaluation`, :mod:`~multigpu.session.metrics`, :mod:`~multigpu.session.progress`:
  what ``evaluate``, ``log`` and ``batches(progress=True)`` rest on.
- :mod:`~multigpu.session.trackers`: the experiment trackers ``log`` and ``log_hparams`` write to, one
  module per library (CSV, TensorBoard, MLflow, W&B, Aim, trackio).

The strategies and precisions themselves live in :mod:`multigpu.strategies`; their public names
are also this package's (a script imports its loop's vocabulary from one place).
"""

from multigpu.session.config import SessionConfig
from multigpu.session.session import Session
from multigpu.strategies import (
    PRECISIONS,
    STRATEGIES,
    DDPOptions,
    FSDPOptions,
    Precision,
    Strategy,
    build_precision,
    build_strategy,
    resolve_strategy_name,
)

__all__ = [
    "PRECISIONS",
    "STRATEGIES",
    "DDPOptions",
    "FSDPOptions",
    "Precision",
    "Session",
    "SessionConfig",
    "Strategy",
    "build_precision",
    "build_strategy",
    "resolve_strategy_name",
]
