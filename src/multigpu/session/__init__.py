"""One training-loop API for every strategy (single / dp / ddp / fsdp), precision and accumulation."""

from multigpu.session.config import SessionConfig
from multigpu.session.ddp_options import DDPOptions
from multigpu.session.fsdp import FSDPOptions
from multigpu.session.precision import PRECISIONS, Precision, build_precision
from multigpu.session.session import Session
from multigpu.session.strategies import STRATEGIES, Strategy, build_strategy, resolve_strategy_name

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
