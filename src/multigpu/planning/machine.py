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

Each keeps its last :data:`HISTORY` solved values; the planner uses their median. A measurement on a
loaded machine is refused, not fed back (on the 2 development cores other work made the measured
steps 2-40x the quiet ones, and a single step 10x slower solves a compute scale of 10): the whole
run when other processes kept the cores busy (:func:`load_besides` above :data:`LOADED` per core),
a strategy when its step is beyond :data:`STEP_BOUND` times its prediction either way. ``advise
--recalibrate`` measures the machine again and starts every history empty.

Example:
    >>> from multigpu.planning.hardware import DEFAULT_HOST
    >>> c = MachineConstants(key="k", host=DEFAULT_HOST, memory_bandwidth=1e10, thread_overhead_s=1e-5,
    ...     allreduce_latency_s=1e-4, allreduce_busbw=2e9, gather_latency_s=1e-4, gather_busbw=1e9,
    ...     fresh_copy_bandwidth=2e9)
    >>> c.with_feedback({"compute_scale": 1.2}).value("compute_scale")
    1.2
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import socket
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multigpu.core.folder_turns import taking_turns
from multigpu.core.limits import to_float
from multigpu.core.run_files import read_json, remove_partials, write_replacing
from multigpu.errors import ConfigError
from multigpu.planning.hardware import HostCosts, Platform, measured_link

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from multigpu.planning.costs import StepTime
    from multigpu.planning.measured import Checked
    from multigpu.planning.workload import Workload

HISTORY = 5  # solved values kept per fed-back constant (their median is used)
# Runnable processes per core besides the measured runs' own above which nothing is fed back: on the 2
# development cores one more busy process already slows a 2-process run 1.5x.
LOADED = 0.5
# A strategy's measured step beyond this factor of its prediction (either way) feeds nothing back: at load
# 1.5-2.1 the calibrated plans came within 31% (docs/planning.md); loaded machines measured 2-40x the quiet step.
STEP_BOUND = 2.0
FED_BACK = ("compute_scale", "thread_overhead_s", "allreduce_busbw", "fsdp_group_s")
# of the file's layout; another version is measured again (3: FSDP2's work per group in a 2-process group;
# 4: DDP's step floor, DataParallel's hand-off timed through the engine; 5: collectives timed in sequences
# between bound processes; 6: fresh memory on 4 KiB pages and on huge pages apart)
_VERSION = 6
CACHE_LIMIT = 1 << 20  # bytes: a cache file is a few kilobytes; anything larger is not one of ours
_TURN_S = 30.0  # seconds another feedback may hold the cache folder (it holds it for milliseconds)


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
    fresh_byte_s: float = 0.0  # and per byte (page faults), on 4 KiB pages
    fresh_huge_byte_s: float = 0.0  # per byte on huge pages (a buffer's bytes past its first 2 MiB or so)
    ddp_step_s: float = 0.0  # what DDP adds to a step beyond its all-reduces (planning.step_floors)
    feedback: dict[str, list[float]] = field(default_factory=dict)
    source: str = "measured here"

    def __post_init__(self) -> None:
        # finite numbers only: the cache is JSON, which reads NaN and Infinity, and a file may be edited by hand
        for name in ("memory_bandwidth", "allreduce_busbw", "gather_busbw", "fresh_copy_bandwidth"):
            if not (_finite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"MachineConstants.{name}={getattr(self, name)} must be a finite number > 0 bytes/s")
        for name in (
            "thread_overhead_s",
            "allreduce_latency_s",
            "gather_latency_s",
            "fresh_alloc_s",
            "fresh_byte_s",
            "fresh_huge_byte_s",
            "ddp_step_s",
        ):
            if not (_finite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ConfigError(f"MachineConstants.{name}={getattr(self, name)} must be a finite number >= 0 seconds")
        if not isinstance(self.feedback, dict) or not isinstance(self.source, str) or not isinstance(self.key, str):
            raise ConfigError(
                f"MachineConstants: feedback={self.feedback!r:.60} must be a dict of histories, source and key "
                "strings; measure again (advise --recalibrate)"
            )
        unknown = set(self.feedback) - set(FED_BACK)
        if unknown:
            raise ConfigError(f"MachineConstants.feedback names {sorted(unknown)}; feedback is one of {FED_BACK}")
        for name, values in self.feedback.items():
            if not isinstance(values, list) or not all(_finite(v) and v >= 0 for v in values):
                raise ConfigError(
                    f"MachineConstants.feedback[{name!r}]={values!r} must be a list of finite numbers >= 0"
                )

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
            fresh_huge_byte_s=self.fresh_huge_byte_s,
            ddp_step_s=self.ddp_step_s,
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


def _finite(value: Any) -> bool:
    """A finite int or float, not a bool (JSON's ``true`` is no bandwidth)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(to_float(value))


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
    """The cached constants of ``key``, or None (none yet, unreadable, another layout or machine; something else
    than a regular file of at most :data:`CACHE_LIMIT` bytes at its name, a named pipe included: never waited on)."""
    path = cache_path(folder, key)
    try:
        constants = MachineConstants.from_json(read_json(path, limit=CACHE_LIMIT))
    except (OSError, ValueError, TypeError, KeyError, ConfigError):  # UnreadableFile is a ValueError
        return None
    return constants if constants.key == key else None


def save(constants: MachineConstants, folder: str | Path) -> Path:
    """Write ``constants`` to their file in ``folder`` whole (a temporary file renamed over it), in its turn: a
    feedback being written (:func:`record_feedback`) ends first, so it cannot write its older copy over these."""
    path = cache_path(folder, constants.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _turn(path.parent, "saved the machine's constants") as held:
        return _write(constants, path, held)


def _write(constants: MachineConstants, path: Path, held: bool) -> Path:
    if held:  # no writer is inside its turn: a partial here is one a killed writer left
        remove_partials(path)
    write_replacing(path, json.dumps(constants.to_json(), indent=2) + "\n")  # a partial per process and thread
    return path


def _turn(folder: Path, doing: str) -> contextlib.AbstractContextManager[bool]:
    """This writer's turn on the cache folder's flock (:mod:`multigpu.core.folder_turns`)."""

    def held_too_long(message: str) -> ConfigError:
        return ConfigError(f"{message} while this advise {doing}; run it again")

    return taking_turns(folder, hold_s=_TURN_S, held_too_long=held_too_long)


def record_feedback(
    folder: str | Path, constants: MachineConstants, solve: Callable[[MachineConstants], Mapping[str, float]]
) -> tuple[dict[str, float], Path | None]:
    """Append what ``solve`` finds from the cached constants to their histories, one writer at a time.

    Two ``advise --measure`` runs feeding back at once each read the file, appended and renamed their copy over
    it, so one's value was lost; here each takes its turn on the folder's flock (:mod:`multigpu.core.folder_turns`)
    from the read to the rename, and solves from the file as the writer before it left it (``constants`` where
    there is none). Returns what was solved and the file written (None: nothing solved, nothing written).

    Raises:
        OSError: the folder cannot be written. ConfigError: another writer held it :data:`_TURN_S` seconds.
    """
    path = cache_path(folder, constants.key)
    with contextlib.suppress(OSError):  # save says what is wrong with the folder, once solved
        path.parent.mkdir(parents=True, exist_ok=True)

    with _turn(path.parent, "fed back its measurement") as held:
        latest = load(folder, constants.key) or constants
        solved = dict(solve(latest))
        return solved, _write(latest.with_feedback(solved), path, held) if solved else None


def _measured_s(checked: Sequence[Checked], strategy: str) -> tuple[float, StepTime] | None:
    for c in checked:
        if c.measured.strategy == strategy and c.measured.ran and c.predicted is not None and c.measured.step_s:
            return c.measured.step_s, c.predicted.step
    return None


def _device_s(step: StepTime, w: Workload, plat: Platform) -> float:
    """The device (compute) share of a predicted step's forward and backward."""
    from multigpu.planning.costs import host_step_s

    return max(0.0, step.parts.get("forward", 0.0) + step.parts.get("backward", 0.0) - host_step_s(w.counts, plat.host))


@dataclass(frozen=True)
class FedBack:
    """What :func:`feed_back` solved (to append to the histories) and what it refused, by constant, with why."""

    solved: dict[str, float]
    refused: dict[str, str]


def load_besides(before: float | None, after: float | None, own: int, cores: int) -> float | None:
    """Runnable processes per core besides the measured runs' own (None: not known).

    ``before`` and ``after``: the 1-minute load average as the runs started and ended; ``own``: the
    most processes a run held (counted out of ``after`` whole, so a short run reads a little low;
    ``before`` holds what ran before it). The larger of the two, over ``cores``.

    Example:
        >>> load_besides(0.3, 2.2, own=2, cores=2), load_besides(6.0, 7.5, own=2, cores=2)
        (0.15, 3.0)
    """
    seen = [load for load in (before, None if after is None else after - own) if load is not None]
    return max(0.0, *seen) / max(1, cores) if seen else None


def _refused_for(ratio: float) -> str | None:
    if 1 / STEP_BOUND <= ratio <= STEP_BOUND:
        return None
    return (
        f"measured {ratio:.3g}x its prediction, beyond {STEP_BOUND:g}x either way: a loaded machine's step "
        "(or a plan to measure again: advise --recalibrate)"
    )


def feed_back(
    constants: MachineConstants,
    w: Workload,
    plat: Platform,
    checked: Sequence[Checked],
    *,
    load: float | None = None,
) -> FedBack:
    """Solve each measured strategy's own constant from its measured step (see the module's list).

    ``w`` and ``plat`` are what the predictions were made from; ``load`` the runnable processes per
    core besides the runs' own while they ran (:func:`load_besides`; None: not known). Above
    :data:`LOADED` every strategy that ran is refused; so is one whose step is beyond
    :data:`STEP_BOUND` times its prediction (re-predicted with what the strategies before it
    solved). In the module's order, each solved constant is put into the plan before the next
    strategy is re-predicted and solved (the compute single solves is in every strategy; the
    all-reduce's bandwidth bounds fsdp's collectives). Strategies that did not run, or whose own
    term cannot absorb the difference, solve nothing; a term is never set below zero.
    """
    from multigpu.planning.costs import PLANNED, ddp_buckets, predict_step
    from multigpu.profiling.bandwidth import bus_factor

    own = {name: row.feeds for name, row in PLANNED.items() if row.feeds is not None}  # what each one's step solves
    ran = {s: m for s in own if (m := _measured_s(checked, s)) is not None}
    if load is not None and load > LOADED:
        why = f"load {load:.2g} per core besides the runs (over {LOADED:g}): their steps are the load's"
        return FedBack({}, {own[s]: why for s in ran})
    fed = FedBack({}, {})

    def again(strategy: str, step: StepTime) -> StepTime:
        return predict_step(strategy, w, plat, chunks=list(step.chunks))

    def bounded(strategy: str, measured: float, predicted: StepTime) -> bool:
        refused = _refused_for(measured / predicted.total_s) if predicted.total_s > 0 else None
        if refused is not None:
            fed.refused[own[strategy]] = f"{strategy} {refused}"
        return refused is None

    if "single" in ran:
        measured, step = ran["single"]
        device = _device_s(step, w, plat)
        if device > 0 and bounded("single", measured, step):
            ratio = max(0.1, (measured - (step.total_s - device)) / device)
            fed.solved["compute_scale"] = constants.value("compute_scale") * ratio
            w = replace(w, compute_s_per_sample=w.compute_s_per_sample * ratio)
    if "dp" in ran:
        measured, step = ran["dp"][0], again("dp", ran["dp"][1])
        if bounded("dp", measured, step):
            rest = step.total_s - step.parts.get("threads", 0.0)
            fed.solved["thread_overhead_s"] = max(0.0, measured - rest) / (2 * step.devices)
            plat = replace(plat, thread_overhead_s=fed.solved["thread_overhead_s"])
    if "ddp" in ran:
        measured, step = ran["ddp"][0], again("ddp", ran["ddp"][1])
        buckets = ddp_buckets(w)
        wire = measured - (step.total_s - step.parts.get("allreduce", 0.0)) - len(buckets) * plat.collective_latency_s
        if bounded("ddp", measured, step) and wire > 0:
            moved = sum(b for b, _ in buckets) * bus_factor("all-reduce", step.devices)
            fed.solved["allreduce_busbw"] = moved / wire
            # fsdp's collectives run at most at the all-reduce's bus bandwidth (Platform.gather_busbw_at)
            plat = replace(plat, link=measured_link(fed.solved["allreduce_busbw"], name=plat.link.name))
    if "fsdp" in ran:
        measured, step = ran["fsdp"][0], again("fsdp", ran["fsdp"][1])
        if bounded("fsdp", measured, step):
            groups = len(w.fsdp.resolved(w.params))
            hooks = groups * plat.host.fsdp_group_s
            fed.solved["fsdp_group_s"] = max(0.0, measured - (step.total_s - hooks)) / groups
    return fed
