"""The interface of a device type: what multigpu asks of one kind of device, and the generic answers.

One :class:`DeviceType` object per type (``cpu``, ``cuda``, ``xpu``, ``mps``) is registered by name
(:mod:`multigpu.devices.registry`). The engine, the profiler, the balancer, the planner's
measurements and the distributed runtime ask that object (synchronize, memory statistics, RNG
state, timing marks, device context, coalesced copies, backend, names) instead of calling
``torch.<type>`` themselves, so supporting another device type is writing one more subclass.

The defaults below go through torch's device module for the type (``torch.get_device_module``:
``torch.xpu``, ``torch.mps``, ...). Not every module has every function in every torch release
this package supports (``torch>=2.4``; e.g. ``torch.xpu.memory_allocated`` arrived after
``torch.xpu`` itself), so each default checks that the function is there and otherwise answers
"not known" (None) or does nothing. ``torch.accelerator`` (torch 2.6+) is not used for these: it
only speaks for the *current* accelerator type, while several types may be registered at once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import torch

from multigpu.devices.peak_flops import peak_flops


class DeviceEvent(Protocol):
    """A timing event recorded on a device stream (a CUDA event and its kin)."""

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


Mark = float | DeviceEvent  # a point in time: the host clock, or an event recorded on a device


@dataclass(frozen=True)
class DeviceCapacity:
    """What nn.DataParallel compares to warn of imbalanced devices."""

    memory: int  # total bytes
    cores: int  # streaming multiprocessors on CUDA


class DeviceType:
    """What multigpu needs to know about, and do on, one type of device.

    Subclasses set the class attributes and override the methods their type does differently;
    a method here that has no answer for a type returns None (the caller then takes its generic
    path: plain ``Tensor.to`` copies, the allocation tracker, the host clock).

    Example:
        >>> from multigpu.devices import get_device_type
        >>> get_device_type("cpu").backend
        'gloo'
    """

    name: ClassVar[str]  # torch's device type name: "cuda", "xpu", ...
    display: ClassVar[str]  # for reports: "CUDA"
    backend: ClassVar[str] = "gloo"  # collective backend of a process computing on this type
    replicas_by_default: ClassVar[bool] = True  # parse_devices(None) takes every device of this type
    pin_memory: ClassVar[bool] = False  # host buffers copied to or from it are worth pinning
    allocator_stats: ClassVar[bool] = False  # its allocator reports bytes allocated and their peak
    timed_with_events: ClassVar[bool] = False  # marks are device events (no sync), else synced host clock
    profiler_activity: ClassVar[str | None] = None  # torch.profiler.ProfilerActivity member, if any
    torch_sync_batchnorm: ClassVar[bool] = False  # torch's nn.SyncBatchNorm runs on it (else CPUSyncBatchNorm)
    # variables a process must have before its first kernel to compute reproducibly on this type
    deterministic_env: ClassVar[Mapping[str, str]] = MappingProxyType({})

    @property
    def module(self) -> Any:
        """torch's module for this type (``torch.xpu``), or None when this torch has none."""
        try:
            return torch.get_device_module(self.name)
        except RuntimeError:
            return None

    def _call(self, function: str, *args: Any) -> Any:
        """``module.function(*args)``; None where this torch lacks the module or the function."""
        found = getattr(self.module, function, None)
        return None if found is None else found(*args)

    # presence ----------------------------------------------------------------------------
    def is_available(self) -> bool:
        """Whether this process can compute on a device of this type."""
        return bool(self._call("is_available"))

    def device_count(self) -> int:
        """How many devices of this type this process sees (0 when none is available)."""
        return int(self._call("device_count") or 0) if self.is_available() else 0

    def default_replicas(self) -> int:
        """How many replicas (dp's threads) or processes (ddp's, one per device) a run on this type takes
        when none are asked for: every device of the type."""
        return self.device_count()

    def default_devices(self) -> str:
        """:meth:`default_replicas` as a device specification for ``parse_devices``: ``"cuda"`` (every
        device), else the first ones by index (``"cuda:0,1"``)."""
        count = self.default_replicas()
        return self.name if count == self.device_count() else self.replicas_spec(count)

    def replicas_spec(self, count: int) -> str:
        """The device specification of ``count`` replicas on this type: its first ``count`` devices (``"cuda:0,1"``)."""
        return f"{self.name}:{','.join(map(str, range(count)))}"

    def is_initialized(self) -> bool:
        """Whether this process has already started the device's runtime (a forked child could not use it)."""
        return bool(self._call("is_initialized"))

    # work and time ---------------------------------------------------------------------------
    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for the work queued on ``device`` (default: the current one). A sync point."""
        self._call("synchronize", *([] if device is None else [device]))

    def mark(self, device: torch.device) -> Mark:
        """Now, for timing work on ``device``: a recorded event, or the host clock after a sync."""
        self.synchronize(device)  # sync point: without events, the host clock must wait for the device
        return time.perf_counter()

    def device_context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Make ``device`` the current device of its type inside the block (replica threads enter it)."""
        enter = getattr(self.module, "device", None)
        return enter(device) if enter is not None else contextlib.nullcontext()

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` this process's current device (one process per device)."""
        self._call("set_device", device)

    def current_device(self) -> torch.device:
        """This process's current device of this type."""
        index = self._call("current_device")
        return torch.device(self.name, index if index is not None else 0)

    def current_stream(self, device: torch.device) -> Any:
        """The stream work on ``device`` is queued to now (None where the type has no streams)."""
        return self._call("current_stream", device)

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Queue this thread's work on ``stream`` (from :meth:`current_stream`) inside the block.

        Replica threads enter the caller's stream of their device: the caller queued the copies
        of their inputs there, so work queued after them on the same stream waits for them.
        """
        enter = getattr(self.module, "stream", None)
        return enter(stream) if enter is not None and stream is not None else contextlib.nullcontext()

    def replica_intra_op_threads(self, replicas: int) -> int | None:
        """Intra-op threads each of ``replicas`` replica threads of this type should compute with.

        Asked on the calling thread before a step's replicas run; None (the default) leaves every
        thread's setting alone. A type whose replicas share the caller's cores divides them.
        """
        return None

    def enter_replica_thread(self, intra_op: int) -> None:
        """Make the calling replica thread compute with ``intra_op`` intra-op threads from now on.

        Called on a replica worker when its count changes, so once per worker in a steady loop.
        ``torch.set_num_threads`` sets the calling thread's count; a thread's first parallel op
        would reset it from the process's figure, so that reset is taken first.
        """
        torch.get_num_threads()
        torch.set_num_threads(intra_op)

    # memory -------------------------------------------------------------------------------
    def has_allocator_stats(self) -> bool:
        """Whether the allocator reports bytes allocated and their peak for this type, in this torch."""
        names = ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")
        return self.allocator_stats and all(hasattr(self.module, name) for name in names)

    def memory_allocated(self, device: torch.device) -> int | None:
        """Bytes the allocator holds for tensors on ``device``; None where it does not say."""
        found = self._call("memory_allocated", device) if self.allocator_stats else None
        return None if found is None else int(found)

    def max_memory_allocated(self, device: torch.device) -> int | None:
        """Peak of :meth:`memory_allocated` since the last reset; None where not known."""
        found = self._call("max_memory_allocated", device) if self.allocator_stats else None
        return None if found is None else int(found)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """Start a new peak for :meth:`max_memory_allocated` (no-op where not known)."""
        if self.allocator_stats:
            self._call("reset_peak_memory_stats", device)

    def sharded_process_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """Variables to start a process with that trains a model sharded by fsdp on this type.

        Such a process allocates and frees every block's gathered parameters and gradients at each
        step; what it frees must serve the next block instead of staying reserved. Nothing by
        default: a caching allocator (CUDA's) reuses its freed blocks. ``environ`` is what the
        process would inherit: a setting the user made there is kept.
        """
        return {}

    # random state -------------------------------------------------------------------------
    def get_rng_state_all(self) -> list[torch.Tensor] | None:
        """The random generator state of every device of this type; None where it has none of its own."""
        states = self._call("get_rng_state_all") if self.is_available() else None
        return None if states is None else list(states)

    def set_rng_state_all(self, states: Sequence[torch.Tensor]) -> None:
        """Put back states from :meth:`get_rng_state_all` (one per device, in index order)."""
        self._call("set_rng_state_all", list(states))

    # coalesced copies (None: the caller moves tensor by tensor) ----------------------------
    def broadcast_coalesced(
        self, tensors: Sequence[torch.Tensor], devices: Sequence[torch.device]
    ) -> list[list[torch.Tensor]] | None:
        """``copies[i][j]``: tensor j on ``devices[i]`` (distinct devices), in few launches; None: no fast path."""
        return None

    def reduce_add_coalesced(
        self, per_replica: Sequence[Sequence[torch.Tensor]], destination: torch.device
    ) -> list[torch.Tensor] | None:
        """Position-wise sums of every replica's tensors on ``destination``; None: no fast path."""
        return None

    # reports ------------------------------------------------------------------------------
    def device_name(self, device: torch.device) -> str:
        """The model name of ``device`` (equal names: equal devices)."""
        found = self._call("get_device_name", device) if self.is_available() else None
        return str(found) if found is not None else self.name

    def peak_flops(self, device: torch.device, dtype: torch.dtype, cache: Path | None = None) -> float:
        """FLOP/s ``device`` reaches at most in ``dtype`` matmuls, MFU's denominator: the datasheet's dense
        figure where :mod:`multigpu.devices.peak_flops` lists the device, else measured once (cached in ``cache``)."""
        return peak_flops(self, device, dtype, cache)

    def capacity(self, device: torch.device) -> DeviceCapacity | None:
        """Total memory and core count, for nn.DataParallel's imbalance warning; None where not reported."""
        return None

    def describe(self, index: int) -> str:
        """One line on device ``index`` for ``multigpu env``."""
        return self.device_name(torch.device(self.name, index))

    def versions(self) -> dict[str, str]:
        """Versions of the libraries this type runs on, for ``multigpu env`` (e.g. cudnn, nccl)."""
        return {}
