"""The process ``multigpu advise --measure`` starts for one strategy: a few timed training steps, written as JSON.

``python _measure_worker.py SPEC.json`` (under ``multigpu launch --strategy ddp|fsdp`` for the
process strategies, plainly for ``single`` and ``dp``: :mod:`multigpu.launcher.measure` starts it).
The spec names either a model factory or a Session script:

- **factory**: the worker builds ``Session(strategy=...)``, the model, the optimizer and a batch of
  random inputs of the per-sample shape, then runs ``zero_grad, forward, stand-in loss, backward,
  step`` through the Session: warm-up steps for at least :data:`WARMUP_S` (2 to
  :data:`MAX_WARMUP_STEPS`, a script's too), then as many timed steps as fit before the spec's
  deadline (``max_steps`` at most), every rank the same counts; then one more step under the
  allocation tracker (:func:`multigpu.profiling.memory.track_memory`) for the peak memory per device.
- **script**: the user's script runs as ``__main__``; a global optimizer-step hook (torch's
  ``register_optimizer_step_post_hook``) times the interval between optimizer steps (those of the first optimizer
  that steps: a GAN's second optimizer steps within the same training step), and global
  forward hooks count the samples of each outermost module call with gradients on; after the
  warm-up and the timed steps the hook ends the script with :class:`MeasureDone` (a
  ``SystemExit(0)``, which ``except Exception`` does not catch). Peak memory: the CUDA
  allocator's, else the process's peak resident memory above what it held at the start.

Each rank writes ``rank<N>.json`` in the spec's folder: step times, samples per step, peak bytes
per device and where they come from.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from multigpu.core.script import importable_from, run_as_main
from multigpu.core.structure import iter_tensors
from multigpu.runtime import peers, world
from multigpu.runtime.collectives import reduce_value

WARMUP_STEPS = 2
# A run warms up for at least this long (at most MAX_WARMUP_STEPS steps, the same count on every
# rank): on the 2 development cores dp's first steps after two warm-ups read 220, 131, 68, 52 ms against 20-25
# later (new threads' allocator arenas, lazily built state), which a quantile of 20 steps does not shed.
WARMUP_S = 0.5
MAX_WARMUP_STEPS = 10
_RESERVE_STEPS = 2  # of the warm-up step time left before the deadline: the memory step and the teardown


class MeasureDone(SystemExit):
    """Ends a measured script after its timed steps: an exit with status 0, past ``except Exception``."""

    def __init__(self) -> None:
        super().__init__(0)


def _rss_bytes() -> int:
    """This process's resident memory now (Linux), else its peak so far."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _reset_peak_rss() -> bool:
    """Restart the kernel's peak-resident count of this process (Linux ``clear_refs``); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """The peak resident memory since the start, or since :func:`_reset_peak_rss` (Linux ``VmHWM``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _timed_steps(warmup_s: float, deadline: float, max_steps: int) -> int:
    """How many steps fit before ``deadline`` at the warm-up's pace; the same on every rank (min)."""
    left = deadline - time.time() - _RESERVE_STEPS * warmup_s
    steps = max(1, min(max_steps, int(left / max(warmup_s, 1e-6))))
    if world.in_process_group():  # every rank must run the same number of collectives
        steps = int(reduce_value(float(steps), "min").item())
    return steps


def _more_warmup(warmup_s: float) -> int:
    """Warm-up steps after the first :data:`WARMUP_STEPS` so that warming spans :data:`WARMUP_S` at their
    pace (:data:`MAX_WARMUP_STEPS` in all at most); the most any rank asks, on every rank."""
    extra = max(0, min(MAX_WARMUP_STEPS, math.ceil(WARMUP_S / max(warmup_s, 1e-6))) - WARMUP_STEPS)
    if world.in_process_group():  # every rank must run the same number of collectives
        extra = int(reduce_value(float(extra), "max").item())
    return extra


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        from multigpu.devices import get_device_type

        get_device_type(device.type).synchronize(device)


def _local_bytes(tensors: Any) -> int:
    """Bytes of ``tensors`` held by this process (a sharded DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _factory(path: str) -> Callable[[], nn.Module]:
    module_name, _, attr = path.partition(":")
    with importable_from():
        return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]


def _inputs(batch: int, shape: list[int], dtype: str, device: torch.device) -> torch.Tensor:
    kind = getattr(torch, dtype)
    if kind.is_floating_point:
        return torch.randn(batch, *shape, dtype=kind, device=device)
    return torch.zeros(batch, *shape, dtype=kind, device=device)


def _memory(model: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], None]) -> dict[str, Any]:
    """Peak bytes per device of one more step: the allocation tracker (CPU) or the allocator (CUDA).

    A sharded model (whose DTensor parameters the tracker cannot follow) reports the bytes it keeps
    between steps (local parameters, gradients, optimizer state) plus what the process's resident
    memory grew by during the step (the kernel's peak count restarted first, so imports, the
    process group and the warm-up are not counted; a freed buffer the allocator keeps resident is
    not counted again)."""
    from multigpu.profiling.memory import track_memory

    sharded = any(hasattr(p, "to_local") for p in model.parameters())
    if not sharded:
        with track_memory(model, optimizer) as tracker:
            step()
        results = tracker.results()
        return {"peak_bytes": [m.peak for m in results], "memory_source": results[0].source}
    params = list(model.parameters())
    kept = _local_bytes(params) + _local_bytes(p.grad for p in params if p.grad is not None)
    kept += _local_bytes(t for s in optimizer.state.values() for t in iter_tensors(dict(s)) if t.dim() > 0)
    before = _rss_bytes()
    reset = _reset_peak_rss()
    step()
    grown = max(0, _peak_rss_bytes() - before) if reset else 0
    return {"peak_bytes": [kept + grown], "memory_source": "process resident memory"}


def run_factory(spec: dict[str, Any]) -> dict[str, Any]:
    """Timed Session steps of the spec's model factory on random inputs."""
    from multigpu.planning.counting import build_optimizer, default_loss
    from multigpu.session import Session

    with Session(strategy=spec["strategy"], devices=spec.get("devices")) as session:
        model = session.setup_model(_factory(spec["factory"])())
        optimizer = build_optimizer(spec["optimizer"], model)
        per_process = max(1, spec["global_batch"] // session.world_size)
        x = _inputs(per_process, spec["input_shape"], spec["input_dtype"], session.device)

        def step() -> None:
            with session.micro_step(model):
                session.backward(default_loss(model(x)))
            session.step(optimizer)

        start = time.perf_counter()
        for _ in range(WARMUP_STEPS):
            step()
        _synchronize(session.device)
        warmup_s = (time.perf_counter() - start) / WARMUP_STEPS
        for _ in range(_more_warmup(warmup_s)):
            step()
        _synchronize(session.device)
        times = []
        for _ in range(_timed_steps(warmup_s, spec["deadline"], spec["max_steps"])):
            t0 = time.perf_counter()
            step()
            _synchronize(session.device)
            times.append(time.perf_counter() - t0)
        return {"step_s": times, "samples": [per_process] * len(times), **_memory(model, optimizer, step)}


_NONE_YET = object()


class _ScriptProbe:
    """Global hooks timing a script's optimizer steps and counting the samples of its outermost forwards."""

    def __init__(self, spec: dict[str, Any], write: Callable[[dict[str, Any]], None]) -> None:
        self.spec, self.write = spec, write
        self.stamps: list[float] = []
        self.samples: list[int] = []
        self.pending = 0  # samples of the forwards since the last optimizer step
        self.depth = 0  # module calls in progress (replica threads of dp run inside the outer one)
        self.lock = threading.Lock()
        self.target: int | None = None
        self.warm = WARMUP_STEPS  # steps whose intervals are not timed (one more: the first has no start)
        self.done = False
        self.clock: Any = _NONE_YET  # the optimizer whose steps are the training steps: the first one to step
        self.accelerator = _accelerator()
        self.handles = [
            register_optimizer_step_post_hook(self.on_step),
            nn.modules.module.register_module_forward_pre_hook(self.on_enter),
            nn.modules.module.register_module_forward_hook(self.on_exit, always_call=True),
        ]

    def on_enter(self, module: nn.Module, args: Any) -> None:
        with self.lock:
            if self.depth == 0 and torch.is_grad_enabled():
                first = next(iter_tensors(args), None)
                self.pending += int(first.shape[0]) if first is not None and first.dim() > 0 else 0
            self.depth += 1

    def on_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        with self.lock:
            self.depth = max(0, self.depth - 1)

    def on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.clock is _NONE_YET:
            self.clock = optimizer
        if optimizer is not self.clock:  # a second optimizer of the same training step (a GAN's): not a step
            return
        if self.accelerator is not None:
            self.accelerator.synchronize()  # the step's kernels are done: a sync point, once per step
        self.stamps.append(time.perf_counter())
        self.samples.append(self.pending)
        self.pending = 0
        if len(self.stamps) == WARMUP_STEPS + 1:  # the interval after the first step: one warm step
            warm = self.stamps[-1] - self.stamps[-2]
            self.warm = WARMUP_STEPS + _more_warmup(warm)
            self.target = self.warm + 1 + _timed_steps(warm, self.spec["deadline"], self.spec["max_steps"])
        if self.target is not None and len(self.stamps) >= self.target:
            self.finish()
            raise MeasureDone

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        for handle in self.handles:
            handle.remove()
        stamps = self.stamps[self.warm :]
        self.write(
            {
                "step_s": [b - a for a, b in itertools.pairwise(stamps)],
                "samples": self.samples[self.warm + 1 :],
            }
        )


def run_script(spec: dict[str, Any], write: Callable[[dict[str, Any]], None]) -> None:
    """The user's Session script, timed by hooks until its timed steps are done (or it ends)."""
    probe = _ScriptProbe(spec, write)
    try:
        run_as_main(spec["script"], spec.get("script_args", []))
    except MeasureDone:
        return
    probe.finish()  # the script ended before its timed steps were done: what it ran is the measurement


def _accelerator() -> Any:
    """The device type of this machine's accelerator (CUDA), or None on a CPU-only machine."""
    from multigpu.devices import accelerator_type, get_device_type

    kind = accelerator_type()
    return None if kind is None else get_device_type(kind)


def _process_memory(rss0: int) -> dict[str, Any]:
    accelerator = _accelerator()
    if accelerator is not None and accelerator.has_allocator_stats():
        devices = [torch.device(accelerator.name, i) for i in range(accelerator.device_count())]
        peaks = [accelerator.max_memory_allocated(d) or 0 for d in devices]
        return {
            "peak_bytes": [p for p in peaks if p > 0] or [0],
            "memory_source": f"{accelerator.name.upper()} allocator",
        }
    return {"peak_bytes": [max(0, _peak_rss_bytes() - rss0)], "memory_source": "process resident memory"}


def main(argv: list[str]) -> None:
    rss0 = _rss_bytes()
    spec = json.loads(Path(argv[0]).read_text())
    env = world.read_launch_env()
    rank = env.global_rank if env is not None else 0
    # torch elastic starts each worker in a session of its own: the parent ends it by this pid, once it
    # proved the process is still this worker (its start time; runtime.peers.signal_group)
    (Path(spec["folder"]) / f"pid{rank}").write_text(f"{os.getpid()} {peers.start_time()}")
    out = Path(spec["folder"]) / f"rank{rank}.json"
    if spec.get("factory"):
        out.write_text(json.dumps({"rank": rank, **run_factory(spec)}))
        return
    written: dict[str, Any] = {}
    run_script(spec, written.update)
    out.write_text(json.dumps({"rank": rank, **written, **_process_memory(rss0)}))


if __name__ == "__main__":
    main(sys.argv[1:])
