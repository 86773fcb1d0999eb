"""This machine's constants for a CPU plan, cached per machine, and what ``advise --measure`` feeds back.

:class:`MachineConstants` holds what does not depend on the model: the host costs, memory
bandwidth, the cost of handing work to a thread, and gloo's collectives as two processes of one
thread each see them (a latency per call and a bus bandwidth: the all-reduce as ddp's processes
run it; the all-gathers and reduce-scatters into fresh buffers as fsdp's processes run them, under
fsdp's malloc settings, with the copy bandwidth into fresh memory there and what a large allocation
costs there per allocation and per byte). It is measured once
(:mod:`multigpu.launcher.machine_probe` starts the two processes) and kept as JSON in
:func:`multigpu.runtime.world.cache_dir`, one file per machine (:func:`machine_key`: host name,
CPU model and count, torch version); ``advise --recalibrate`` measures it again.

Feedback: a measured run of each strategy fixes the one constant only that strategy's equation
holds, the others' held at their values (:func:`feed_back`):

- ``single`` -> ``compute_scale``: the worker's compute over the calibration's (a process with the
  launcher's environment, e.g. its thread count, can compute at another speed);
- ``dp`` -> ``thread_overhead_s``: DataParallel's per-replica, per-phase handoff;
- ``ddp`` -> ``allreduce_busbw``: gloo's all-reduce inside DDP (latency per bucket kept);
- ``fsdp`` -> ``fsdp_group_s``: FSDP2's work per group and step.

Each keeps its last :data:`HISTORY` solved values; the planner uses their median, so one run on a
loaded machine moves it little.

Example:
    >>> from multigpu.planning.hardware import DEFAULT_HOST
    >>> c = MachineConstants(key="k", host=DEFAULT_HOST, memory_bandwidth=1e10, thread_overhead_s=1e-5,
    ...     allreduce_latency_s=1e-4, allreduce_busbw=2e9, gather_latency_s=1e-4, gather_busbw=1e9,
    ...     fresh_copy_bandwidth=2e9)
    >>> c.with_feedback({"compute_scale": 1.2}).value("compute_scale")
    1.2
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multigpu.errors import ConfigError
from multigpu.planning.hardware import HostCosts, Platform, measured_link

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from multigpu.planning.costs import StepTime
    from multigpu.planning.measured import Checked
    from multigpu.planning.workload import Workload

HISTORY = 5  # solved values kept per fed-back constant (their median is used)
FED_BACK = ("compute_scale", "thread_overhead_s", "allreduce_busbw", "fsdp_group_s")
_VERSION = 2  # of the file's layout; another version is measured again (2: large allocations' costs)


@dataclass(frozen=True, kw_only=True)
class MachineConstants:
    """What a CPU plan needs of this machine besides the model (seconds, bytes/s)."""

    key: str
    host: HostCosts
    memory_bandwidth: float
    thread_overhead_s: float
    allreduce_latency_s: float
    allreduce_busbw: float
    gather_latency_s: float
    gather_busbw: float
    fresh_copy_bandwidth: float
    fresh_alloc_s: float = 0.0  # fsdp's processes: a large allocation beyond reused memory, per allocation
    fresh_byte_s: float = 0.0  # and per byte (page faults)
    feedback: dict[str, list[float]] = field(default_factory=dict)
    source: str = "measured here"

    def __post_init__(self) -> None:
        for name in ("memory_bandwidth", "allreduce_busbw", "gather_busbw", "fresh_copy_bandwidth"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"MachineConstants.{name}={getattr(self, name)} must be > 0 bytes/s")
        for name in ("fresh_alloc_s", "fresh_byte_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"MachineConstants.{name}={getattr(self, name)} must be >= 0 seconds")
        unknown = set(self.feedback) - set(FED_BACK)
        if unknown:
            raise ConfigError(f"MachineConstants.feedback names {sorted(unknown)}; feedback is one of {FED_BACK}")
        for name, values in self.feedback.items():
            if not isinstance(values, list) or not all(isinstance(v, (int, float)) and v >= 0 for v in values):
                raise ConfigError(f"MachineConstants.feedback[{name!r}]={values!r} must be a list of numbers >= 0")

    def value(self, name: str) -> float:
        """A fed-back constant: the median of its solved values, else the probe's figure (1 for the scale)."""
        if self.feedback.get(name):
            return float(statistics.median(self.feedback[name]))
        if name == "compute_scale":
            return 1.0
        if name == "fsdp_group_s":
            return self.host.fsdp_group_s
        return float(getattr(self, name))

    def with_feedback(self, solved: Mapping[str, float]) -> MachineConstants:
        """These constants with ``solved`` values appended to their histories (the last :data:`HISTORY` kept)."""
        feedback = {k: list(v) for k, v in self.feedback.items()}
        for name, v in solved.items():
            feedback[name] = [*feedback.get(name, []), float(v)][-HISTORY:]
        return replace(self, feedback=feedback)

    def platform(self, *, cores: int, contention: float, single_speedup: float) -> Platform:
        """This CPU as a platform, with the model's own measured contention and one-process speed-up."""
        return Platform(
            name="cpu",
            memory_bytes=None,
            memory_bandwidth=self.memory_bandwidth,
            link=measured_link(self.value("allreduce_busbw"), name="gloo (measured)"),
            peer_copies=False,
            overlap=0.0,  # one thread per process: gloo's thread takes its cycles from backward
            cores=cores,
            contention=max(1.0, contention),
            thread_overhead_s=self.value("thread_overhead_s"),
            host=replace(self.host, fsdp_group_s=self.value("fsdp_group_s")),
            synchronous=True,
            gather_busbw=self.gather_busbw,
            collective_latency_s=self.allreduce_latency_s,
            gather_latency_s=self.gather_latency_s,
            sharded_copy_bandwidth=self.fresh_copy_bandwidth,
            fresh_alloc_s=self.fresh_alloc_s,
            fresh_byte_s=self.fresh_byte_s,
            single_speedup=single_speedup,
        )

    def to_json(self) -> dict[str, Any]:
        return {"version": _VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MachineConstants:
        if not isinstance(data, dict) or data.get("version") != _VERSION:
            raise ConfigError(f"machine constants: not a layout-{_VERSION} object ({str(data)[:60]})")
        fields = dict(data)
        del fields["version"]
        fields["host"] = HostCosts(**fields["host"])
        return cls(**fields)


def machine_key() -> str:
    """Host name, CPU model and count, torch version: a new file when any changes."""
    import torch

    model = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{socket.gethostname()} | {model} | {os.cpu_count()} cpus | torch {torch.__version__}"


def cache_path(folder: str | Path, key: str) -> Path:
    """The file of ``key``'s constants in ``folder``."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(folder) / f"planner-machine-{digest}.json"


def load(folder: str | Path, key: str) -> MachineConstants | None:
    """The cached constants of ``key``, or None (none yet, unreadable, another layout or machine)."""
    path = cache_path(folder, key)
    try:
        constants = MachineConstants.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError, ConfigError):
        return None
    return constants if constants.key == key else None


def save(constants: MachineConstants, folder: str | Path) -> Path:
    """Write ``constants`` to their file in ``folder`` whole (a temporary file renamed over it)."""
    path = cache_path(folder, constants.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(constants.to_json(), indent=2) + "\n")
    partial.replace(path)
    return path


def _measured_s(checked: Sequence[Checked], strategy: str) -> tuple[float, StepTime] | None:
    for c in checked:
        if c.measured.strategy == strategy and c.measured.ran and c.predicted is not None and c.measured.step_s:
            return c.measured.step_s, c.predicted.step
    return None


def _device_s(step: StepTime, w: Workload, plat: Platform) -> float:
    """The device (compute) share of a predicted step's forward and backward."""
    from multigpu.planning.costs import host_step_s

    return max(0.0, step.parts.get("forward", 0.0) + step.parts.get("backward", 0.0) - host_step_s(w.counts, plat.host))


def feed_back(constants: MachineConstants, w: Workload, plat: Platform, checked: Sequence[Checked]) -> dict[str, float]:
    """Solve each measured strategy's own constant from its measured step (see the module's list).

    ``w`` and ``plat`` are what the predictions were made from. In the module's order, each solved
    constant is put into the plan before the next strategy is re-predicted and solved (the compute
    single solves is in every strategy; the all-reduce's bandwidth bounds fsdp's collectives). Returns the solved
    values (strategies that did not run, or whose own term cannot absorb the difference, solve
    nothing; a term is never set below zero).
    """
    from multigpu.planning.costs import predict_step

    solved: dict[str, float] = {}
    single = _measured_s(checked, "single")
    if single is not None:
        measured, step = single
        device = _device_s(step, w, plat)
        if device > 0:
            ratio = max(0.1, (measured - (step.total_s - device)) / device)
            solved["compute_scale"] = constants.value("compute_scale") * ratio
            w = replace(w, compute_s_per_sample=w.compute_s_per_sample * ratio)

    def again(strategy: str, step: StepTime) -> StepTime:
        return predict_step(strategy, w, plat, chunks=list(step.chunks))

    dp = _measured_s(checked, "dp")
    if dp is not None:
        step = again("dp", dp[1])
        handoffs = 2 * step.devices
        rest = step.total_s - step.parts.get("threads", 0.0)
        solved["thread_overhead_s"] = max(0.0, dp[0] - rest) / handoffs
        plat = replace(plat, thread_overhead_s=solved["thread_overhead_s"])
    ddp = _measured_s(checked, "ddp")
    if ddp is not None:
        step = again("ddp", ddp[1])
        own = ddp[0] - (step.total_s - step.parts.get("allreduce", 0.0))
        from multigpu.planning.costs import ddp_buckets
        from multigpu.profiling.bandwidth import bus_factor

        buckets = ddp_buckets(w)
        moved = sum(b for b, _ in buckets) * bus_factor("all-reduce", step.devices)
        wire = own - len(buckets) * plat.collective_latency_s
        if wire > 0:
            solved["allreduce_busbw"] = moved / wire
            # fsdp's collectives run at most at the all-reduce's bus bandwidth (Platform.gather_busbw_at)
            plat = replace(plat, link=measured_link(solved["allreduce_busbw"], name=plat.link.name))
    fsdp = _measured_s(checked, "fsdp")
    if fsdp is not None:
        step = again("fsdp", fsdp[1])
        groups = len(w.fsdp.resolved(w.params))
        hooks = groups * plat.host.fsdp_group_s
        solved["fsdp_group_s"] = max(0.0, fsdp[0] - (step.total_s - hooks)) / groups
    return solved
