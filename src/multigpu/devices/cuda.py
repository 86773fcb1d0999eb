"""CUDA as a device type: the one module of multigpu that calls ``torch.cuda``.

What CUDA adds to the generic device type: allocator statistics (``memory_allocated``, peaks),
timing with events recorded on the current stream (marking never synchronizes; reading the
elapsed time does), ``torch.cuda.comm``'s coalesced broadcast and reduce-add (one kernel launch
per bucket instead of one per tensor), pinned host buffers, nccl between processes, and the
device properties nn.DataParallel's imbalance warning compares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from multigpu.core.units import format_bytes
from multigpu.devices.base import DeviceCapacity, DeviceType, Mark


class CudaDevice(DeviceType):
    """NVIDIA (and ROCm, which torch also calls ``cuda``) GPUs."""

    name = "cuda"
    display = "CUDA"
    backend = "nccl"
    pin_memory = True
    allocator_stats = True
    timed_with_events = True
    profiler_activity = "CUDA"
    torch_sync_batchnorm = True
    # cuBLAS is reproducible only with a fixed workspace; it reads the variable when it creates a handle
    deterministic_env: ClassVar[Mapping[str, str]] = MappingProxyType({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.cuda.synchronize(device)

    def mark(self, device: torch.device) -> Mark:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def device_context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(device)

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)  # None: a no-op, as torch.cuda.stream documents

    def memory_allocated(self, device: torch.device) -> int | None:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device: torch.device) -> int | None:
        return torch.cuda.max_memory_allocated(device)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def get_rng_state_all(self) -> list[torch.Tensor] | None:
        return list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else None

    def set_rng_state_all(self, states: Sequence[torch.Tensor]) -> None:
        torch.cuda.set_rng_state_all(list(states))

    def broadcast_coalesced(
        self, tensors: Sequence[torch.Tensor], devices: Sequence[torch.device]
    ) -> list[list[torch.Tensor]] | None:
        from torch.cuda import comm  # imported on first use: only CUDA replicas need it

        return [list(copies) for copies in comm.broadcast_coalesced(list(tensors), list(devices))]

    def reduce_add_coalesced(
        self, per_replica: Sequence[Sequence[torch.Tensor]], destination: torch.device
    ) -> list[torch.Tensor] | None:
        from torch.cuda import comm

        return list(comm.reduce_add_coalesced(per_replica, destination=destination.index))  # type: ignore[arg-type]

    def device_name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device)

    def capacity(self, device: torch.device) -> DeviceCapacity | None:
        props = torch.cuda.get_device_properties(device)
        return DeviceCapacity(props.total_memory, props.multi_processor_count)

    def describe(self, index: int) -> str:
        props = torch.cuda.get_device_properties(index)
        return f"{props.name}, {format_bytes(props.total_memory)}, capability {props.major}.{props.minor}"

    def versions(self) -> dict[str, str]:
        import torch.distributed as dist

        nccl = "-"
        available = torch.cuda.is_available()
        if available and dist.is_nccl_available():
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        cudnn = str(torch.backends.cudnn.version() or "-") if available else "-"
        return {"cudnn": cudnn, "nccl": nccl}
