"""How one training script uses the devices: one module per strategy, plus precision.

- :mod:`~multigpu.strategies.single`: one process, one device.
- :mod:`~multigpu.strategies.dp`: one process, one replica per device in threads.
- :mod:`~multigpu.strategies.ddp`: one launched process per device, gradients all-reduced (DDP).
- :mod:`~multigpu.strategies.fsdp`: as ddp, with parameters, gradients and optimizer state sharded (FSDP2).
- :mod:`~multigpu.strategies.precision`: fp32, bf16, fp16 as small objects (fsdp adapts them).
- :mod:`~multigpu.strategies.sync_batchnorm`: BatchNorm over the global batch under ddp/fsdp.
- :mod:`~multigpu.strategies.activation_checkpointing`: chosen blocks recompute their activations in backward.
- :mod:`~multigpu.strategies.base`: what a strategy is and the facts it owns;
  :mod:`~multigpu.strategies.registry`: the strategies by name.

Adding a strategy is one module with a :class:`Strategy` subclass (its facts as class
attributes), listed in the registry. The names are imported on first use, so ``strategy_names()``
answers without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from multigpu.strategies.base import Strategy
    from multigpu.strategies.ddp import DDPOptions
    from multigpu.strategies.fsdp import FSDPOptions
    from multigpu.strategies.precision import PRECISIONS, Precision, build_precision
    from multigpu.strategies.registry import (
        STRATEGIES,
        build_strategy,
        get_strategy,
        multi_device_strategies,
        process_strategies,
        resolve_strategy_name,
        strategy_labels,
    )

# public name -> its module: imported when first used, so that multigpu.strategies.registry's names
# (strategy_names) are read without torch (the CLI builds its parser from them)
_SOURCES: dict[str, str] = {
    "Strategy": "multigpu.strategies.base",
    "DDPOptions": "multigpu.strategies.ddp",
    "FSDPOptions": "multigpu.strategies.fsdp",
    **dict.fromkeys(("PRECISIONS", "Precision", "build_precision"), "multigpu.strategies.precision"),
    **dict.fromkeys(
        (
            "STRATEGIES",
            "build_strategy",
            "get_strategy",
            "multi_device_strategies",
            "process_strategies",
            "resolve_strategy_name",
            "strategy_labels",
        ),
        "multigpu.strategies.registry",
    ),
}

__all__ = [
    "PRECISIONS",
    "STRATEGIES",
    "DDPOptions",
    "FSDPOptions",
    "Precision",
    "Strategy",
    "build_precision",
    "build_strategy",
    "get_strategy",
    "multi_device_strategies",
    "process_strategies",
    "resolve_strategy_name",
    "strategy_labels",
]


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module 'multigpu.strategies' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_SOURCES])
