"""Quick measurements on this CPU: a model's workload, and this CPU as a platform.

``measure_workload`` counts one step (:mod:`multigpu.planning.counting`), times forward + backward
of one batch and the optimizer step (fastest of repeats), and keeps as per-sample compute what
the host's share (counts x host costs) leaves. ``measure_cpu_platform`` measures what CPU
replicas share: memory bandwidth (a copy), how much each replica slows when two run at once
(plain PyTorch in two threads, no multigpu code), the host costs (:mod:`multigpu.planning.calibrate`)
and the cost of handing work to a thread. ``allreduce_busbw`` times an all-reduce in a process group.

Example:
    >>> from torch import nn
    >>> w = measure_workload(nn.Linear(64, 8), torch.randn(32, 64), repeats=3)
    >>> w.params
    520
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from multigpu.errors import ConfigError
from multigpu.planning.calibrate import fastest_s, measure_host_costs
from multigpu.planning.counting import LossFn, count_step, default_loss
from multigpu.planning.hardware import measured_link
from multigpu.planning.host import DEFAULT_HOST, HostCosts, backward_host_s, forward_host_s
from multigpu.planning.platform import Platform
from multigpu.planning.workload import Workload
from multigpu.profiling.bandwidth import bus_factor

# Per-sample compute never drops below this share of the measured step: host costs measured on a
# busy machine can exceed what the step itself took.
_MIN_DEVICE_SHARE = 0.1


def measure_workload(
    model: nn.Module,
    inputs: torch.Tensor,
    *,
    loss_fn: LossFn = default_loss,
    optimizer: str = "sgd-momentum",
    repeats: int = 7,
    name: str = "model",
    host: HostCosts = DEFAULT_HOST,
) -> Workload:
    """Measure ``model`` on the device its parameters are on, with a batch ``inputs``.

    Args:
        model: the model, on its device.
        inputs: one batch (dim 0 is the batch); a small one is enough, compute scales linearly.
        loss_fn: output -> scalar loss (default: mean square of the first output).
        optimizer: ``sgd``, ``sgd-momentum``, ``adam`` or ``adamw``: the step that is timed.
        repeats: timed repeats; the fastest is kept (other work on the machine only adds time).
        name: the workload's name in reports.
        host: the host costs whose share of the timed step is not per-sample compute.

    Returns:
        Per-sample compute seconds, activation/output/input bytes per sample, parameters, host
        counts and the measured optimizer step.
    """
    counted = count_step(model, inputs, loss_fn=loss_fn)
    batch = counted.batch
    opt = _build_optimizer(optimizer, model)
    sync = torch.cuda.synchronize if inputs.is_cuda else (lambda: None)

    def compute() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs)).backward()
        sync()  # a sync point: the time must include the device's work

    step_s = fastest_s(compute, repeats)
    optimizer_s = fastest_s(lambda: (opt.step(), sync()), repeats)
    model.zero_grad(set_to_none=True)
    host_s = forward_host_s(counted.counts, host) + backward_host_s(counted.counts, host)
    return Workload(
        name=name,
        params=counted.params,
        compute_s_per_sample=device_seconds(step_s, host_s) / batch,
        input_bytes_per_sample=counted.input_bytes / batch,
        output_bytes_per_sample=counted.output_bytes / batch,
        activation_bytes_per_sample=counted.saved_bytes / batch,
        optimizer=optimizer,
        optimizer_s=optimizer_s,
        counts=counted.counts,
    )


def device_seconds(step_s: float, host_s: float) -> float:
    """What a timed step leaves to the device once the host's share is out (at least a tenth of it).

    Example:
        >>> device_seconds(1.0, 0.25), device_seconds(1.0, 5.0)
        (0.75, 0.1)
    """
    return max(step_s - host_s, _MIN_DEVICE_SHARE * step_s)


def _build_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if name in ("adam", "adamw"):
        return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=1e-4)
    raise ConfigError(f"optimizer={name!r} is not one of sgd, sgd-momentum, adam, adamw")


def memory_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 7) -> float:
    """Bytes/s of a large CPU copy (read + write counted)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / fastest_s(lambda: dst.copy_(src), repeats)


class ReplicaProbe:
    """Times one replica alone and ``replicas`` at once, on long-lived threads.

    Plain PyTorch on copies of ``model`` that share its weights (as CPU replicas do) and keep their
    own gradients: what the cores and memory of this machine give to concurrent replicas, not what
    any engine does with them. The threads live as long as the probe, like an engine's replica
    threads (fresh threads would pay first-use costs, e.g. new allocator arenas, every time).

    Example:
        >>> with ReplicaProbe(nn.Linear(8, 8), torch.randn(4, 8)) as probe:
        ...     solo, together = probe.times(repeats=1)
    """

    def __init__(self, model: nn.Module, chunk: torch.Tensor, *, replicas: int = 2, loss_fn: LossFn = default_loss):
        self._copies = [_sharing_copy(model) for _ in range(replicas)]
        self._chunk, self._loss_fn = chunk, loss_fn
        self._pool = ThreadPoolExecutor(max_workers=replicas, thread_name_prefix="multigpu-probe")

    def _one(self, i: int) -> None:
        self._copies[i].zero_grad(set_to_none=True)
        self._loss_fn(self._copies[i](self._chunk)).backward()

    def times(self, *, repeats: int = 3) -> tuple[float, float]:
        """(one replica alone, all at once): best forward + backward seconds of ``repeats``."""
        together = fastest_s(lambda: list(self._pool.map(self._one, range(len(self._copies)))), repeats)
        solo = fastest_s(lambda: self._pool.submit(self._one, 0).result(), repeats)
        return solo, together

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ReplicaProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sharing_copy(model: nn.Module) -> nn.Module:
    """A copy whose parameters share the original's storage (as CPU replicas do) with their own grads."""
    clone = copy.deepcopy(model)
    for mine, theirs in zip(clone.parameters(), model.parameters()):
        mine.data = theirs.data
    return clone


def device_contention(solo_s: float, together_s: float, host_s: float = 0.0) -> float:
    """How much slower a replica's device share runs while the others run (at least 1).

    ``solo_s`` and ``together_s`` are one replica's step alone and with the others; ``host_s``, the
    host's share of it (the model charges the GIL's queue to the host, not to the device).

    Example:
        >>> device_contention(1.0, 1.5), device_contention(1.0, 1.5, host_s=0.5)
        (1.5, 2.0)
    """
    device = max(solo_s - host_s, _MIN_DEVICE_SHARE * solo_s)
    return max(1.0, (together_s - solo_s + device) / device)


def replica_contention(
    model: nn.Module,
    chunk: torch.Tensor,
    *,
    replicas: int = 2,
    loss_fn: LossFn = default_loss,
    rounds: int = 5,
    host_s: float = 0.0,
) -> float:
    """How much slower one replica's device share runs while ``replicas`` run in threads.

    Solo and concurrent runs alternate over ``rounds``, so a change in machine load touches both;
    the best times go to :func:`device_contention`.
    """
    with ReplicaProbe(model, chunk, replicas=replicas, loss_fn=loss_fn) as probe:
        solo, together = zip(*(probe.times() for _ in range(rounds)))
    return device_contention(min(solo), min(together), host_s)


def thread_handoff_s(repeats: int = 50) -> float:
    """Seconds to hand one task to a waiting pool thread and get its result back."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return fastest_s(lambda: pool.submit(threading.get_ident).result(), repeats)


def measure_cpu_platform(
    model: nn.Module,
    chunk: torch.Tensor,
    *,
    replicas: int = 2,
    busbw: float | None = None,
    loss_fn: LossFn = default_loss,
    rounds: int = 5,
    host: HostCosts | None = None,
    host_s: float = 0.0,
) -> Platform:
    """This CPU as a platform for ``replicas`` replicas of ``model`` (``chunk``: one replica's batch).

    Args:
        busbw: measured all-reduce bus bandwidth in bytes/s (``allreduce_busbw`` in a gloo group,
            or ``multigpu bandwidth``); defaults to the memory bandwidth.
        host: this machine's host costs (default: measured now, with the engine's replicate).
        host_s: the host's share of one replica's step on ``chunk`` (counts x host costs).
    """
    mem_bw = memory_bandwidth()
    return Platform(
        name="cpu",
        memory_bytes=None,
        memory_bandwidth=mem_bw,
        link=measured_link(busbw if busbw is not None else mem_bw / 2, name="gloo (measured)"),
        peer_copies=False,
        overlap=0.0,  # replicas fill the cores: a communication thread takes cycles from compute
        cores=os.cpu_count() or 1,
        contention=replica_contention(model, chunk, replicas=replicas, loss_fn=loss_fn, rounds=rounds, host_s=host_s),
        thread_overhead_s=thread_handoff_s(),
        host=host if host is not None else measure_host_costs(replicate="multigpu"),
        synchronous=True,
    )


def allreduce_busbw(nbytes: int, *, repeats: int = 7) -> float:
    """Bus bandwidth (bytes/s) of an all-reduce of ``nbytes`` float32 in the default process group.

    Every rank must call it (it runs collectives). busbw = nbytes / t * 2(n-1)/n (nccl-tests).
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    tensor = torch.ones(max(1, nbytes // 4))
    seconds = fastest_s(lambda: dist.all_reduce(tensor), repeats)
    return tensor.numel() * 4 / seconds * bus_factor("all-reduce", world)


def gather_busbw(group_bytes: Sequence[int], *, repeats: int = 7) -> float:
    """Bus bandwidth (bytes/s) of fsdp's collectives over groups of ``group_bytes`` (float32) each.

    Every rank must call it (it runs collectives). One step's worth, as FSDP2 issues them: an
    all-gather of every group, another of every group but the first (the root's, kept gathered),
    then a reduce-scatter of every group in reverse, each into buffers allocated for it (FSDP2
    allocates them anew every step; on a CPU the first touch of fresh memory is part of the cost).
    busbw = sum of S (n-1)/n over the time of the sequence (nccl-tests: busbw = algbw (n-1)/n for
    both, S the whole array).
    """
    import torch.distributed as dist

    # torch 2.13 renamed the two (the old names warn); torch 2.4 has only the old ones
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    world = dist.get_world_size()
    if world < 2 or not group_bytes:
        raise ConfigError(
            f"world_size={world}, groups {list(group_bytes)}: fsdp's collectives need at least 2 processes "
            "and one group; call it in every rank of a group of 2 or more"
        )
    shards = [max(1, nbytes // 4 // world) for nbytes in group_bytes]
    gathers = shards + shards[1:]

    def step() -> None:
        for shard in gathers:
            all_gather(torch.empty(shard * world), torch.ones(shard))
        for shard in reversed(shards):
            reduce_scatter(torch.empty(shard), torch.ones(shard * world))

    moved = sum(shard * world * 4 for shard in [*gathers, *shards]) * bus_factor("all-gather", world)
    return moved / fastest_s(step, repeats)
