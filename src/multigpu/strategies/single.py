"""The ``single`` strategy: one process, one device (default: the first GPU, else the CPU).

The baseline every other strategy is checked against: ``Session(strategy="single")`` trains as
plain PyTorch on one device would.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from multigpu.devices import DeviceSpec, parse_devices
from multigpu.errors import ConfigError
from multigpu.runtime.world import DEFAULT_TIMEOUT_S
from multigpu.strategies.base import OneProcessStrategy


class SingleStrategy(OneProcessStrategy):
    """One process, one device (default: the first GPU, else the CPU)."""

    name: ClassVar[str] = "single"
    label: ClassVar[str] = "single device"
    multi_device: ClassVar[bool] = False

    def __init__(self, *, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S, precision: str = "fp32") -> None:
        super().__init__(timeout_s=timeout_s, precision=precision)
        self._device = device

    @classmethod
    def build(
        cls,
        *,
        devices: DeviceSpec = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        precision: str = "fp32",
        options: Any = None,
    ) -> SingleStrategy:
        """``devices``' one device (default: the first GPU, else the CPU); ``options``: none, ignored.

        Raises:
            ConfigError: ``devices`` names several devices.
        """
        parsed = parse_devices(devices)
        if devices is not None and len(parsed) > 1:
            raise ConfigError(
                f"strategy 'single' runs on one device but devices={devices!r} names {len(parsed)}; "
                "use strategy='dp' (threads) or 'ddp' (processes) for several"
            )
        return cls(device=parsed[0].device, timeout_s=timeout_s, precision=precision)

    @property
    def device(self) -> torch.device:
        return self._device

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model.to(self._device)
