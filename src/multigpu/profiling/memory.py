"""Per-device memory accounting for one training step, on CPU replicas as on CUDA.

Devices whose type reports allocator statistics (CUDA): the allocator's ``memory_allocated`` at
the start and ``max_memory_allocated`` over the step, asked of the device type
(:mod:`multigpu.devices`). Other devices (CPU): every replica runs in its own thread, so an
allocation tracker (a ``TorchDispatchMode``, which is thread-local) entered in each replica
thread sees exactly the storages that replica's forward and backward create; a finalizer on each
storage sees it freed. That makes DataParallel's primary-device imbalance measurable without GPUs.
The engine enters the tracker in each replica thread through its replica scope: the tracker is a
listener attached to the model for the block's duration (:mod:`multigpu.profiling.attach`).

What each figure of a :class:`DeviceMemory` includes:

* ``resident``: bytes the device holds when the step starts: the parameters (every replica holds
  a copy; CPU replicas share the primary's storage, and the figure counts the copy a separate
  device would hold), plus, on the primary, gradients and optimizer state left from earlier steps;
* ``activations``: peak bytes allocated by the replica's forward and backward (activations, tensors
  saved for backward, the replica's gradient buffers before they are summed);
* ``gathered``: primary only: peak bytes allocated on the calling thread outside replica work:
  gathered outputs, the loss and its backward, the gradient reduction and the optimizer step;
* ``peak``: ``resident`` plus the peak of everything allocated during the step (on the primary,
  activations and gathered counted together at the same instant).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from multigpu.core.structure import iter_tensors
from multigpu.devices import DeviceType, ReplicaDevice, device_type_names, get_device_type
from multigpu.profiling.attach import attached

_CATEGORIES = ("activations", "gathered")


@dataclass
class DeviceMemory:
    """Peak memory of one device over one step, in bytes (see the module docstring)."""

    label: str
    resident: int
    activations: int
    gathered: int
    peak: int
    source: str  # "allocation tracker" (CPU) or "<type> allocator" ("CUDA allocator")


@dataclass
class _Ledger:
    """Live bytes per category of one device, and their peak; updated from several threads."""

    current: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_CATEGORIES, 0))
    peak_total: int = 0
    peak_by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_CATEGORIES, 0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def alloc(self, category: str, nbytes: int) -> None:
        with self.lock:
            self.current[category] += nbytes
            self.peak_by_category[category] = max(self.peak_by_category[category], self.current[category])
            self.peak_total = max(self.peak_total, sum(self.current.values()))

    def free(self, category: str, nbytes: int) -> None:
        with self.lock:
            self.current[category] -= nbytes

    def reset_peak(self) -> None:
        with self.lock:
            self.peak_total = sum(self.current.values())
            self.peak_by_category = dict(self.current)


class _Tracker(TorchDispatchMode):
    """Counts the storages that ops run on this thread create, until each is freed."""

    def __init__(self, ledger: _Ledger, category: str, device: torch.device) -> None:
        super().__init__()
        self.ledger = ledger
        self.category = category
        self.device = device
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in iter_tensors((args, kwargs))}
        for tensor in iter_tensors(out):
            if tensor.device.type != self.device.type or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self.seen:
                continue
            nbytes = storage.nbytes()
            self.seen.add(key)
            self.ledger.alloc(self.category, nbytes)
            weakref.finalize(storage, self._freed, key, self.category, nbytes)
        return out

    def _freed(self, key: int, category: str, nbytes: int) -> None:
        self.seen.discard(key)
        self.ledger.free(category, nbytes)


def _key(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
        return -1


def _allocator(device: torch.device) -> DeviceType | None:
    """The device's type when its allocator reports statistics (CUDA), else None (use the tracker)."""
    kind = get_device_type(device.type)
    return kind if kind.has_allocator_stats() else None


def _allocator_devices() -> list[tuple[DeviceType, torch.device]]:
    """Every device of every available type with allocator statistics."""
    found = []
    for name in device_type_names():
        kind = get_device_type(name)
        if name != "cpu" and kind.is_available() and kind.has_allocator_stats():
            found += [(kind, torch.device(name, i)) for i in range(kind.device_count())]
    return found


class MemoryTracker:
    """Measures per-device peak memory over the steps run inside :func:`track_memory`.

    An engine listener: the engine enters :meth:`replica_scope` on each replica's thread. Also a
    memory source for the step profiler (:func:`multigpu.profiling.step.profile_steps`):
    ``peak_bytes()`` and ``reset_peaks()`` give and restart the per-step peaks by device label.
    """

    def __init__(self, devices: list[ReplicaDevice], resident: dict[str, int]) -> None:
        self.devices = devices  # empty: devices are learnt from the replica scopes as they run
        self.resident = resident
        self.caller = threading.get_ident()
        self.caller_ledger = _Ledger()
        self.ledgers = {devices[0].label: self.caller_ledger} if devices else {}
        self._caller_trackers: list[_Tracker] = []

    @contextlib.contextmanager
    def replica_scope(self, label: str, device: torch.device) -> Iterator[None]:
        """Count what the replica ``label`` allocates inside the block (entered on the replica's thread)."""
        if _allocator(device) is not None:  # the allocator counts it already
            yield
            return
        if threading.get_ident() == self.caller and self._caller_trackers:
            self.ledgers.setdefault(label, self.caller_ledger)  # replica 0 is the primary
            tracker = self._caller_trackers[-1]  # same tracker as the caller, other category
            previous, tracker.category = tracker.category, "activations"
            try:
                yield
            finally:
                tracker.category = previous
            return
        with _Tracker(self._ledger(label), "activations", device):
            yield

    def _ledger(self, label: str) -> _Ledger:
        """Replica ``label``'s ledger; the primary's is the caller's, which also holds what the caller gathers.

        CPU replicas (every replica, replica 0 too, on a worker thread of its own) reach here; devices
        learnt as they run (``multigpu profile``) have the primary labelled ``cpu:0`` (``cpu`` alone), as
        :func:`multigpu.devices.parse_devices` numbers CPU replicas in order.
        """
        primary = label in ("cpu", "cpu:0") and not self.devices
        return self.ledgers.setdefault(label, self.caller_ledger if primary else _Ledger())

    def results(self) -> list[DeviceMemory]:
        """One :class:`DeviceMemory` per device, the primary first."""
        out = []
        for device in self.devices:
            resident = self.resident[device.label]
            allocator = _allocator(device.device)
            if allocator is not None:
                peak = allocator.max_memory_allocated(device.device) or 0
                source = f"{allocator.display} allocator"
                out.append(DeviceMemory(device.label, resident, peak - resident, 0, peak, source))
                continue
            ledger = self.ledgers.get(device.label, _Ledger())
            out.append(
                DeviceMemory(
                    device.label,
                    resident,
                    ledger.peak_by_category["activations"],
                    ledger.peak_by_category["gathered"],
                    resident + ledger.peak_total,
                    "allocation tracker",
                )
            )
        return out

    def primary_ratio(self) -> float:
        """Primary peak over the largest peak among the other devices (1.0 is balanced)."""
        peaks = [m.peak for m in self.results()]
        return peaks[0] / max(peaks[1:]) if len(peaks) > 1 and max(peaks[1:]) > 0 else 1.0

    def peak_bytes(self) -> dict[str, int]:
        """Peak bytes per device label since the last :meth:`reset_peaks` (profiler interface)."""
        peaks = {label: self.resident.get(label, 0) + ledger.peak_total for label, ledger in self.ledgers.items()}
        for kind, device in _allocator_devices():
            peaks[str(device)] = kind.max_memory_allocated(device) or 0
        return peaks

    def reset_peaks(self) -> None:
        """Start a new peak from what is live now (profiler interface: called at every step's end)."""
        for ledger in self.ledgers.values():
            ledger.reset_peak()
        for kind, device in _allocator_devices():
            kind.reset_peak_memory_stats(device)


@contextlib.contextmanager
def track_memory(
    model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
) -> Iterator[MemoryTracker]:
    """Measure per-device peak memory of the training step(s) run inside the block.

    Args:
        model: a :class:`multigpu.DataParallel` (one figure per replica device) or a bare module;
            the tracker is attached to every DataParallel in it for the block. None (as ``multigpu
            profile`` does): it is attached to every DataParallel called in the block, devices are
            learnt as replicas run, and peaks count what the steps allocate, without resident parameters.
        optimizer: counted as resident state on the primary when given.

    Returns:
        The tracker; read ``tracker.results()`` after the block.

    Example:
        >>> with track_memory(model, optimizer) as mem:      # doctest: +SKIP
        ...     loss = model(x, target=y); loss.backward(); optimizer.step()
        >>> [m.peak for m in mem.results()]                   # doctest: +SKIP
    """
    devices = _devices_of(model) if model is not None else []
    for device in devices:
        allocator = _allocator(device.device)
        if allocator is not None:
            allocator.reset_peak_memory_stats(device.device)
    resident = _resident_bytes(devices, model, optimizer) if model is not None else {}
    tracker = MemoryTracker(devices, resident)
    primary = devices[0].device if devices else torch.device("cpu")
    caller = _Tracker(tracker.caller_ledger, "gathered", primary)
    tracker._caller_trackers.append(caller)
    with attached(tracker, model), caller if _allocator(primary) is None else contextlib.nullcontext():
        yield tracker


def _devices_of(model: nn.Module) -> list[ReplicaDevice]:
    devices = getattr(model, "replica_devices", None)
    if devices:
        return list(devices)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    return [ReplicaDevice(device, str(device))]


def _resident_bytes(
    devices: list[ReplicaDevice], model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, int]:
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state_bytes = 0
    if optimizer is not None:
        state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in iter_tensors(dict(s)))
    resident = {d.label: param_bytes for d in devices}
    resident[devices[0].label] += grad_bytes + state_bytes
    allocator = _allocator(devices[0].device)
    if allocator is not None:
        resident[devices[0].label] = allocator.memory_allocated(devices[0].device) or 0
    return resident
