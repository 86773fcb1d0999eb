"""The step profiler: where each step's time, bytes and memory go, per phase and per device.

Opt-in and off by default: an engine's phase marks cost one attribute read while nobody is
attached to it. Inside :func:`profile_steps` a :class:`StepProfiler` is attached to the model's
engines (:mod:`multigpu.profiling.attach`) and hears every phase (from every replica thread),
times ``optimizer.step()`` through optimizer hooks and the wait for each DataLoader batch
(:mod:`multigpu.profiling.data_wait`), and closes a step each time the optimizer steps. Phases on an accelerator are timed as its device type marks time
(:mod:`multigpu.profiling.clock`): on CUDA with events on the device's current stream, read once,
when :meth:`StepProfiler.profile` is called (the only sync point).

Example:
    >>> model = multigpu.DataParallel(net, devices="cpu:2")
    >>> with profile_steps(model, optimizer=opt, config=ProfileConfig(devices=["cpu:0", "cpu:1"])) as prof:
    ...     for x, y in batches:
    ...         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    >>> profile = prof.profile()   # StepProfile: render with multigpu.report
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from multigpu.core.listeners import PhaseListener
from multigpu.devices import accelerator_type, get_device_type
from multigpu.errors import ConfigError
from multigpu.profiling import clock
from multigpu.profiling.attach import attached
from multigpu.profiling.data_wait import timing_data_waits
from multigpu.profiling.records import PhaseStat, StepProfile, StepRecord

_now = time.perf_counter


class MemorySource(Protocol):
    """Per-device peak memory, read at the end of every step (e.g. the allocation tracker)."""

    def reset_peaks(self) -> None: ...

    def peak_bytes(self) -> Mapping[str, int]: ...


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """What the step profiler keeps.

    Args:
        warmup: steps run but not kept (the first step pays one-time costs: allocations, thread start).
        devices: report labels of the replicas, primary first (``["cuda:0", "cuda:1"]``); phases the
            engine reports without a device (scatter, replicate, gather, reduce, optimizer) are
            charged to the primary. None: the lowest label seen is taken as the primary.
        trace_ranges: also open a ``torch.profiler.record_function`` range per phase, so the
            phases appear by name in a Chrome trace.
    """

    warmup: int = 1
    devices: Sequence[str] | None = None
    trace_ranges: bool = False

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ConfigError(f"warmup={self.warmup} must be >= 0 (steps to run before keeping numbers)")
        if self.devices is not None and len(self.devices) == 0:
            raise ConfigError("devices=[] names no device; pass the replica labels, e.g. ['cpu:0', 'cpu:1'], or None")


_Raw = tuple[str, "str | None", clock.Mark, clock.Mark, int]  # phase, device, start, stop, bytes
_HostToken = tuple[str, "str | None", float]  # phase, device, start
_Token = tuple[str, "str | None", clock.Mark, "torch.device | None", Any]  # phase, device, start, timed on, trace range


class StepProfiler:
    """A phase listener (:class:`~multigpu.core.listeners.PhaseListener`) that groups phases into steps.

    Thread-safe for the engines' use: ``begin``/``end`` of one phase run on one thread; finished
    phases are appended to a list (atomic), and steps close on the optimizer's thread after the
    replica threads have joined.
    """

    def __init__(
        self,
        config: ProfileConfig | None = None,
        *,
        memory: MemorySource | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config or ProfileConfig()
        self.memory = memory
        self.on_step = on_step
        primary = self.config.devices[0] if self.config.devices else None
        self._primary_on = clock.device_of(primary)
        self._on: dict[str | None, torch.device | None] = {None: self._primary_on}
        self._host_only = accelerator_type() is None and not self.config.trace_ranges
        self._events: list[_Raw] = []
        self._steps: list[tuple[int, clock.Mark, clock.Mark, list[_Raw], dict[str, int]]] = []
        self._seen = 0
        self._step_start = clock.mark(self._primary_on)
        self._optimizer_token: Any = None
        if memory is not None:
            memory.reset_peaks()

    # PhaseListener -------------------------------------------------------------------------
    def begin(self, name: str, device: str | None) -> object:
        if self._host_only:  # fast path: no accelerator anywhere, no trace ranges (keeps "on" under 3%)
            return (name, device, _now())
        on = self._on[device] if device in self._on else self._remember(device)
        scope = None
        if self.config.trace_ranges:
            scope = torch.profiler.record_function(f"multigpu::{name}")
            scope.__enter__()
        return (name, device, clock.mark(on), on, scope)

    def end(self, token: object, nbytes: int) -> None:
        if self._host_only:
            host = cast(_HostToken, token)
            self._events.append((host[0], host[1], host[2], _now(), nbytes))  # list.append: atomic across threads
            return
        name, device, start, on, scope = cast(_Token, token)  # the tuple begin() returned
        stop = clock.mark(on)
        if scope is not None:
            scope.__exit__(None, None, None)
        self._events.append((name, device, start, stop, nbytes))

    # steps ---------------------------------------------------------------------------------
    def step(self) -> None:
        """Close the current step (called by the optimizer hook; call it yourself without one)."""
        stop = clock.mark(self._primary_on)
        events, self._events = self._events, []
        peaks = self._read_memory()
        index, self._seen = self._seen, self._seen + 1
        if index >= self.config.warmup:
            self._steps.append((index, self._step_start, stop, events, peaks))
        self._step_start = clock.mark(self._primary_on)
        if self.on_step is not None:
            self.on_step(len(self._steps))

    @property
    def steps_run(self) -> int:
        """Steps closed so far, warm-up included."""
        return self._seen

    def optimizer_pre_hook(self, *_: Any) -> None:
        self._optimizer_token = self.begin("optimizer", None)

    def optimizer_post_hook(self, *_: Any) -> None:
        if self._optimizer_token is not None:
            self.end(self._optimizer_token, 0)
            self._optimizer_token = None
        self.step()

    def profile(self) -> StepProfile:
        """The kept steps as a :class:`StepProfile` (reads device events: a sync point)."""
        labels = {e[1] for _, _, _, events, _ in self._steps for e in events if e[1] is not None}
        devices = list(self.config.devices) if self.config.devices else _ordered(labels)
        primary = devices[0] if devices else "cpu"
        steps = [
            StepRecord(
                index=index,
                wall_s=clock.seconds_between(start, stop),
                phases=_aggregate(events, primary),
                peak_bytes=peaks,
            )
            for index, start, stop, events, peaks in self._steps
        ]
        for label in {p.device for s in steps for p in s.phases} - set(devices):
            devices.append(label)
        timing = _timing(devices)
        meta = {"torch": torch.__version__, "warmup": self.config.warmup, "memory": self.memory is not None}
        return StepProfile(devices=devices or [primary], steps=steps, timing=timing, meta=meta)

    def _remember(self, device: str | None) -> torch.device | None:
        on = clock.device_of(device)
        self._on[device] = on
        return on

    def _read_memory(self) -> dict[str, int]:
        if self.memory is None:
            return {}
        peaks = {str(k): int(v) for k, v in self.memory.peak_bytes().items()}
        self.memory.reset_peaks()
        return peaks


@contextlib.contextmanager
def profile_steps(
    model: nn.Module | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    config: ProfileConfig | None = None,
    memory: MemorySource | contextlib.AbstractContextManager[MemorySource] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> Iterator[StepProfiler]:
    """Profile every step run inside the block; one step ends at each ``optimizer.step()``.

    Args:
        model: the model whose engines are profiled (a DataParallel, or a model holding some);
            None: every engine called inside the block (found as it is called).
        optimizer: the optimizer whose ``step()`` ends a step; None hooks every optimizer.
        config: warmup, device labels, trace ranges (see :class:`ProfileConfig`).
        memory: per-device peak memory, read and reset at the end of every step: a source
            (``reset_peaks()``, ``peak_bytes()``), or a context manager giving one, such as
            ``track_memory()``, which is entered for the block. When the source is also a phase
            listener (has ``begin``/``end``), it is attached to the engines too.
        on_step: called after every step with the number of steps kept so far.

    Returns:
        The profiler; call ``.profile()`` after the block for the numbers.
    """
    with contextlib.ExitStack() as stack:
        source = _memory_source(memory, stack)
        profiler = StepProfiler(config, memory=source, on_step=on_step)
        if optimizer is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            handles = [
                register_optimizer_step_pre_hook(profiler.optimizer_pre_hook),
                register_optimizer_step_post_hook(profiler.optimizer_post_hook),
            ]
        else:
            handles = [
                optimizer.register_step_pre_hook(profiler.optimizer_pre_hook),
                optimizer.register_step_post_hook(profiler.optimizer_post_hook),
            ]
        for handle in handles:
            stack.callback(handle.remove)
        stack.enter_context(attached(profiler, model))
        stack.enter_context(timing_data_waits(profiler))
        if isinstance(source, PhaseListener):  # it begins each phase after the profiler, ends it before
            stack.enter_context(attached(source, model))
        yield profiler


def _memory_source(memory: Any, stack: contextlib.ExitStack) -> MemorySource | None:
    """``memory=`` as a source: itself, or what entering it gives (``track_memory()`` is entered for the block)."""
    if memory is None or _is_source(memory):
        return cast("MemorySource | None", memory)
    if isinstance(memory, contextlib.AbstractContextManager):
        entered = stack.enter_context(memory)
        if _is_source(entered):
            return cast(MemorySource, entered)
    raise ConfigError(
        f"memory={memory!r} is not a memory source: pass track_memory() (or the tracker it gives), "
        "or an object with reset_peaks() and peak_bytes() -> {'cpu:0': bytes, ...}"
    )


def _is_source(obj: Any) -> bool:
    return callable(getattr(obj, "reset_peaks", None)) and callable(getattr(obj, "peak_bytes", None))


def _aggregate(events: list[_Raw], primary: str) -> list[PhaseStat]:
    """Sum the raw phases of one step per (phase, device)."""
    stats: dict[tuple[str, str], PhaseStat] = {}
    for name, device, start, stop, nbytes in events:
        key = (name, device or primary)
        seconds = clock.seconds_between(start, stop)
        if key in stats:
            stat = stats[key]
            stat.seconds += seconds
            stat.calls += 1
            stat.nbytes += nbytes
        else:
            stats[key] = PhaseStat(phase=name, device=key[1], seconds=seconds, nbytes=nbytes)
    return list(stats.values())


def _timing(labels: Sequence[str]) -> str:
    """How the profile's phases were timed: ``"cuda events"`` where a device's type times with events."""
    for label in labels:
        on = clock.device_of(label)
        if on is not None and get_device_type(on.type).timed_with_events:
            return f"{on.type} events"
    return "host clock"


def _ordered(labels: set[str]) -> list[str]:
    """Labels in device order: by type, then index (``cpu:2`` before ``cpu:10``)."""

    def key(label: str) -> tuple[str, int]:
        match = re.match(r"^([a-z]+)(?::(\d+))?$", label)
        return (match[1], int(match[2] or -1)) if match else (label, -1)

    return sorted(labels, key=key)
