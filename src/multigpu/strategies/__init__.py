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
attributes), listed in the registry.
"""

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
