"""The CPU as a device type: always there, one device (any number of replicas on it), no queue to wait for.

Nothing runs asynchronously on the CPU, so synchronizing is a no-op and the host clock times it.
Its memory has no allocator statistics: per-replica memory comes from the allocation tracker
(:mod:`multigpu.profiling.memory`). Its random state is torch's default generator, which callers
read with ``torch.get_rng_state()``; it has no per-device generators of its own.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from multigpu.devices.base import DeviceType, Mark


class CpuDevice(DeviceType):
    """The CPU (see the module docstring)."""

    name = "cpu"
    display = "CPU"
    backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def synchronize(self, device: torch.device | None = None) -> None:
        return None  # CPU ops have finished when they return

    def mark(self, device: torch.device) -> Mark:
        return time.perf_counter()

    def device_context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def set_device(self, device: torch.device) -> None:
        return None

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def current_stream(self, device: torch.device) -> Any:
        return None

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def get_rng_state_all(self) -> list[torch.Tensor] | None:
        return None  # torch.get_rng_state() is the CPU's state; callers keep it under its own name

    def set_rng_state_all(self, states: Any) -> None:
        return None

    def device_name(self, device: torch.device) -> str:
        return "cpu"

    def describe(self, index: int) -> str:
        return "cpu"
