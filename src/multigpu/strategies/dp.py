"""The ``dp`` strategy: one process, one replica per device in threads (:class:`multigpu.DataParallel`).

The loader yields the whole global batch and the engine splits it between the replicas. Default
devices: every GPU, else two CPU replicas (``multigpu launch --strategy dp --devices`` chooses).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from multigpu.devices import DeviceSpec, ReplicaDevice, parse_devices, replica_device_type
from multigpu.parallel import DataParallel
from multigpu.runtime import world
from multigpu.runtime.world import DEFAULT_TIMEOUT_S
from multigpu.strategies.base import OneProcessStrategy


class DataParallelStrategy(OneProcessStrategy):
    """One process, one replica per device in threads (default: every GPU, else two CPU replicas)."""

    name: ClassVar[str] = "dp"
    label: ClassVar[str] = "DataParallel"
    launch_devices: ClassVar[bool] = True
    variants: ClassVar[Mapping[str, str]] = {"dp-balanced": "balanced DataParallel"}  # chunk_sizes="auto"

    def __init__(
        self, *, replicas: list[ReplicaDevice], timeout_s: float = DEFAULT_TIMEOUT_S, precision: str = "fp32"
    ) -> None:
        super().__init__(timeout_s=timeout_s, precision=precision)
        self.replicas = replicas

    @classmethod
    def build(
        cls,
        *,
        devices: DeviceSpec = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        precision: str = "fp32",
        options: Any = None,
    ) -> DataParallelStrategy:
        """Replicas on ``devices``, else on ``multigpu launch --devices``, else every GPU, else two CPU
        replicas; ``options``: none, ignored."""
        spec = devices if devices is not None else world.requested_devices()
        replicas = parse_devices(spec if spec is not None else replica_device_type().default_devices())
        return cls(replicas=replicas, timeout_s=timeout_s, precision=precision)

    @property
    def replicas_per_process(self) -> int:
        return len(self.replicas)

    @property
    def device(self) -> torch.device:
        return self.replicas[0].device

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return DataParallel(model.to(self.device), devices=[r.label for r in self.replicas])

    def apply_compile(self, model: nn.Module) -> nn.Module:
        warnings.warn(
            "compile=True has no effect under strategy 'dp': its replicas are copied from the model at "
            "every step, which torch.compile would retrace; compile under 'single', 'ddp' or 'fsdp'",
            stacklevel=3,
        )
        return model
