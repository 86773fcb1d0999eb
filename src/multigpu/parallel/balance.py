"""``chunk_sizes="auto"``: chunk sizes that equalise per-device peak memory.

Algorithm (run once per distinct batch size, logged once):

1. **Probe.** On the second step of a batch size (the first one creates the gradients and the
   optimizer state, which are part of the steady state), one extra forward and backward of the real batch with an even split, under the
   per-device memory tracker (:mod:`multigpu.profiling.memory`). The loss is the real one when
   DataParallel computes it on the replicas (``loss_fn=`` or a model that returns its loss);
   otherwise a proxy ``sum(out * out)`` on the gathered outputs, which allocates what a typical
   criterion does (an output-sized intermediate and an output-sized gradient). Parameter
   gradients, buffers (BatchNorm statistics) and the RNG state are restored afterwards, so the
   probe leaves training exactly as it was.
2. **Model.** Device i's peak is ``base_i + rate_i * n_i``: ``rate_i`` is the activation bytes per
   sample the probe measured on that device; ``base_i`` is the rest of its measured peak (resident
   parameters, gradients and optimizer state, and on the primary the gathered outputs and loss,
   which depend on the whole batch, not on the primary's chunk).
3. **Water-filling.** Find the level L at which ``sum_i max(0, (L - base_i) / rate_i)`` equals the
   batch, give device i that many samples (largest-remainder rounding); a device whose base is
   above the level gets 0 and runs no replica.
4. **Speed.** When the devices are not all the same model (e.g. two different GPUs), the probe's
   forward+backward time per sample is measured too, and the memory-balanced sizes are moved
   towards a time-balanced split as far as the memory level allows (each device may rise to 5%
   above the memory level). Identical devices (every CPU replica) are balanced on memory alone, so
   the plan is deterministic for the same inputs.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from multigpu.devices import DeviceCapacity, ReplicaDevice
from multigpu.parallel.chunks import proportional_sizes
from multigpu.profiling import phases
from multigpu.profiling.memory import DeviceMemory, track_memory

log = logging.getLogger("multigpu.balance")

_TIME_SLACK = 1.05
_IMBALANCE = 0.75  # nn.DataParallel's threshold: a device with less than 75% of another's memory or cores


@dataclass(frozen=True)
class BalancePlan:
    """The chunk sizes chosen for one batch size, with what was measured and why."""

    batch: int
    sizes: list[int]
    probe: list[DeviceMemory]
    rates: list[float]  # activation bytes per sample, per device
    bases: list[float]  # peak bytes that do not scale with the device's chunk
    predicted: list[float]  # predicted peak bytes per device with ``sizes``
    seconds_per_sample: list[float] | None  # only measured when devices differ

    def explain(self) -> str:
        """One paragraph for the log: measured, chosen, why."""
        mib = 2**20
        measured = ", ".join(f"{m.label} {m.peak / mib:.1f} MiB" for m in self.probe)
        chosen = ", ".join(f"{m.label} {n}" for m, n in zip(self.probe, self.sizes))
        predicted = ", ".join(f"{p / mib:.1f}" for p in self.predicted)
        return (
            f"auto-balance for batch {self.batch}: an even split peaked at {measured}; "
            f"per-sample activations {', '.join(f'{r / 1024:.0f} KiB' for r in self.rates)}; "
            f"chose chunks {chosen}, predicted peaks {predicted} MiB (equal peaks minimise the largest)"
        )


def imbalance_warning(labels: Sequence[str], capacities: Sequence[DeviceCapacity]) -> str | None:
    """nn.DataParallel's ``_check_balance``: a device with < 75% of another's memory or cores.

    Returns:
        The warning to give (naming both devices, the numbers and the fix), or None when balanced.

    Example:
        >>> imbalance_warning(["cuda:0", "cuda:1"], [DeviceCapacity(24 << 30, 80), DeviceCapacity(8 << 30, 40)])[:40]
        'cuda:1 has 33% of the memory of cuda:0 '
    """
    for what, values in (("memory", [c.memory for c in capacities]), ("cores", [c.cores for c in capacities])):
        low = min(range(len(values)), key=values.__getitem__)
        high = max(range(len(values)), key=values.__getitem__)
        if values[high] > 0 and values[low] / values[high] < _IMBALANCE:
            return (
                f"{labels[low]} has {values[low] / values[high]:.0%} of the {what} of {labels[high]} "
                f"({values[low]:,} vs {values[high]:,}); with an even split the smaller device limits every step. "
                f"Pass chunk_sizes='auto' to size each device's chunk by its measured memory and speed, "
                f"or leave {labels[low]} out of the devices"
            )
    return None


def water_fill(bases: Sequence[float], rates: Sequence[float], batch: int) -> list[int]:
    """Integer chunk sizes summing to ``batch`` that equalise ``base_i + rate_i * n_i``.

    Example:
        >>> water_fill([100.0, 0.0], [1.0, 1.0], 200)
        [50, 150]
    """
    if any(r <= 0 for r in rates):
        return proportional_sizes(batch, [1.0] * len(rates))

    def filled(level: float) -> float:
        return sum(max(0.0, (level - b) / r) for b, r in zip(bases, rates))

    low, high = min(bases), max(bases) + max(rates) * batch
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if filled(mid) < batch else (low, mid)
    shares = [max(0.0, (high - b) / r) for b, r in zip(bases, rates)]
    if not all(math.isfinite(s) for s in shares) or not any(shares):
        # rates so small (subnormal) that a share overflows, or vanishes beside equal bases: samples
        # cost nothing next to the bases, so the devices at the level split the batch evenly
        shares = [1.0 if b <= high else 0.0 for b in bases]
    return proportional_sizes(batch, shares)


def plan_from_probe(
    batch: int, even: Sequence[int], probe: list[DeviceMemory], seconds: list[float] | None
) -> BalancePlan:
    """Turn one probe's measurements into a plan (steps 2-4 of the module docstring)."""
    rates = [m.activations / n if n else 0.0 for m, n in zip(probe, even)]
    bases = [m.peak - r * n for m, r, n in zip(probe, rates, even)]
    sizes = water_fill(bases, rates, batch)
    per_sample = None
    if seconds is not None:
        per_sample = [s / n if n else 0.0 for s, n in zip(seconds, even)]
        sizes = _towards_time_balance(sizes, bases, rates, per_sample, batch)
    predicted = [b + r * n for b, r, n in zip(bases, rates, sizes)]
    return BalancePlan(batch, sizes, probe, rates, bases, predicted, per_sample)


def _towards_time_balance(
    sizes: list[int], bases: list[float], rates: list[float], per_sample: list[float], batch: int
) -> list[int]:
    if any(t <= 0 for t in per_sample):
        return sizes
    level = max(b + r * n for b, r, n in zip(bases, rates, sizes)) * _TIME_SLACK
    caps = [int((level - b) / r) if r > 0 else batch for b, r in zip(bases, rates)]
    wanted = proportional_sizes(batch, [1.0 / t for t in per_sample])
    chosen = [min(w, c) for w, c in zip(wanted, caps)]
    spare = batch - sum(chosen)
    for i in sorted(range(len(chosen)), key=lambda i: per_sample[i]):  # fastest devices take the rest
        extra = min(spare, max(0, caps[i] - chosen[i]))
        chosen[i] += extra
        spare -= extra
    return chosen if spare == 0 else sizes


class AutoBalancer:
    """Plans chunk sizes per batch size from one probe step each (see the module docstring)."""

    def __init__(self, devices: Sequence[ReplicaDevice], module: nn.Module) -> None:
        self.devices = list(devices)
        self.plans: dict[int, BalancePlan] = {}
        self.seen: set[int] = set()
        self.attach(module)

    def attach(self, module: nn.Module) -> None:
        """Watch for the optimizer that steps ``module``'s parameters (again, for a copied model).

        DataParallel keeps the optimizer state on the primary; the probe must count it, so the
        balancer remembers that optimizer, spotted by a process-wide optimizer-step hook (no new
        API for the user). The hook is removed by :meth:`close`.
        """
        self.optimizer: weakref.ref[torch.optim.Optimizer] | None = None
        self._param_ids = {id(p) for p in module.parameters()}
        self.hook = register_optimizer_step_post_hook(_OptimizerSpotter(weakref.ref(self)))

    def close(self) -> None:
        """Remove the optimizer hook (DataParallel calls this from its ``close()`` and when collected)."""
        self.hook.remove()

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()  # a copy is attached to its own model (DataParallel.__setstate__)
        for name in ("hook", "optimizer", "_param_ids"):
            state.pop(name, None)
        return state

    def sizes(self, batch: int, probe: Callable[[list[int]], None], wrapper: nn.Module) -> list[int] | None:
        """Chunk sizes for ``batch``, probing first if this batch size is new; None: use an even split."""
        if batch in self.plans:
            return self.plans[batch].sizes
        if not (torch.is_grad_enabled() and wrapper.training):
            return None  # inference: nothing to balance against, keep it cheap
        if batch not in self.seen:  # the first step of a batch size creates gradients and optimizer
            self.seen.add(batch)  # state; probing the second one measures the steady state
            return None
        even = proportional_sizes(batch, [1.0] * len(self.devices))
        timer = _ReplicaTimer()
        optimizer = self.optimizer() if self.optimizer else None
        with _preserved(wrapper), track_memory(wrapper, optimizer) as memory, phases.listening(timer):
            probe(even)
        seconds = None if _identical(self.devices) else [timer.seconds.get(d.label, 0.0) for d in self.devices]
        plan = plan_from_probe(batch, even, memory.results(), seconds)
        self.plans[batch] = plan
        log.info(plan.explain())
        return plan.sizes


class _OptimizerSpotter:
    """Global optimizer-step hook: tells the balancer which optimizer steps its parameters."""

    def __init__(self, balancer: weakref.ref[AutoBalancer]) -> None:
        self.balancer = balancer

    def __call__(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        balancer = self.balancer()
        if balancer is None or balancer.optimizer is not None:
            return
        if any(id(p) in balancer._param_ids for group in optimizer.param_groups for p in group["params"]):
            balancer.optimizer = weakref.ref(optimizer)


class _ReplicaTimer:
    """Phase listener of the probe: forward + backward seconds per device (synchronised on CUDA)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.lock = threading.Lock()

    def begin(self, name: str, device: str | None) -> object:
        return (name, device, time.perf_counter())

    def end(self, token: object, nbytes: int) -> None:
        name, device, began = cast("tuple[str, str | None, float]", token)
        if name not in ("forward", "backward") or device is None:
            return
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        with self.lock:
            self.seconds[device] = self.seconds.get(device, 0.0) + time.perf_counter() - began


def _identical(devices: Sequence[ReplicaDevice]) -> bool:
    if all(d.type == "cpu" for d in devices):
        return True
    if all(d.type == "cuda" for d in devices):
        return len({torch.cuda.get_device_name(d.device) for d in devices}) == 1
    return len({d.type for d in devices}) == 1


class _preserved:
    """Keep the probe step out of the user's gradients, buffers and RNG state.

    The gradients are set aside (each ``.grad`` set to None) before the probe and put back after
    it: the probe's backward writes into fresh tensors, so gradients that were zeroed in place
    (``zero_grad(set_to_none=False)``) or accumulated over micro-batches stay exactly as they were.
    """

    def __init__(self, wrapper: nn.Module) -> None:
        self.module: nn.Module = wrapper.module  # type: ignore[assignment]

    def __enter__(self) -> None:
        tensors = [*self.module.parameters(), *(b for b in self.module.buffers() if b.requires_grad)]
        self.grads = [(t, t.grad) for t in tensors]
        for tensor in tensors:
            tensor.grad = None
        self.buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def __exit__(self, *exc: object) -> None:
        for tensor, grad in self.grads:
            tensor.grad = grad
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
