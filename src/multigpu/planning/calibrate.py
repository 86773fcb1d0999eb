"""Measure this machine: its host costs, what CPU replicas share, and the collectives' bandwidth.

The host costs (:class:`~multigpu.planning.hardware.HostCosts`) take about a second.

Each constant is the low quantile (:mod:`multigpu.planning.timing`) of ``repeats`` timings of a probe,
by its thread's CPU time (each probe runs on one thread: other processes on a shared machine only
keep it off the core), divided by the items it holds, counted as :mod:`multigpu.planning.counting` counts:

- ``op_s``: ``y = y.add(1)`` on a one-element tensor, from Python (one dispatched op each);
- ``module_call_s``: an ``nn.Sequential`` of ``nn.Identity`` modules (calls without ops);
- ``backward_op_s``: backward of a chain of multiplications, over the ops it dispatches;
- ``gil_contention``: the op loop on ``threads`` long-lived threads at once, over ``threads`` times
  one thread's time (1: the GIL serialises them perfectly; above 1: taking turns costs extra); wall
  time of a loop a tenth as long, over more repeats (threads that wait on each other);
- ``replicate_module_s`` / ``replicate_tensor_s``: replicating a tree of empty modules, and one
  module holding many parameters, per module and per tensor. ``replicate="torch"`` times
  ``torch.nn.parallel.replicate`` (what nn.DataParallel runs on GPUs; its CUDA-only coalesced
  broadcast replaced by detached views, whose bytes the broadcast term of the model pays);
  ``"multigpu"`` times the engine's own :func:`multigpu.parallel.replicas.build_replicas`;
- ``fsdp_group_s``: a training step (zero_grad, forward, backward, SGD step) of a stack of tiny
  Linear layers, each its own ``fully_shard`` group, against the same stack unsharded, per group:
  FSDP2's hooks and bookkeeping, in a one-process gloo group (no collective runs). Where a process
  group already exists the probe is skipped and the development machine's figure kept.

It also measures what CPU replicas share: memory bandwidth (a copy), how much each replica slows
when two run at once (:class:`ReplicaProbe`: plain PyTorch in two threads, no multigpu code) and
the cost of handing work to a thread; :mod:`multigpu.planning.cpu_plan` builds this CPU's platform
from them and the machine's cached constants (:mod:`multigpu.planning.machine`). :func:`allreduce_busbw` and
:func:`gather_busbw` time ddp's and fsdp's collectives in a process group (every rank calls them).

Run it (prints the host costs):  python -m multigpu.planning.calibrate

Example:
    >>> measure_host_costs(items=200, repeats=2).op_s > 0
    True
"""

from __future__ import annotations

import copy
import importlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn

from multigpu.core.lookup import lookup
from multigpu.errors import ConfigError
from multigpu.parallel.replicas import build_replicas
from multigpu.planning.counting import LossFn, OpCounter, default_loss, device_seconds
from multigpu.planning.hardware import DEFAULT_HOST, TIME_FIELDS, HostCosts
from multigpu.planning.timing import (
    CPU_CLOCK,
    RATIO_QUANTILE,
    REPEATS,
    SHORT_REPEATS,
    WAIT_QUANTILE,
    low_quantile,
    quantile_s,
)
from multigpu.profiling.bandwidth import bus_factor


def _cpu_s(fn: Callable[[], object], repeats: int) -> float:
    """A one-thread probe's seconds: the low quantile of its thread's CPU time (other processes only add wall time)."""
    return quantile_s(fn, repeats, clock=CPU_CLOCK)


def _op_loop(items: int) -> Callable[[], object]:
    x = torch.ones(1)

    def run() -> None:
        y = x
        for _ in range(items):
            y = y.add(1)

    return run


def _module_call_s(items: int, repeats: int) -> float:
    modules, x = nn.Sequential(*[nn.Identity() for _ in range(items)]), torch.ones(1)
    return _cpu_s(lambda: modules(x), repeats) / items


def _backward_op_s(items: int, repeats: int) -> float:
    x = torch.ones(1, requires_grad=True)

    def forward() -> torch.Tensor:
        y = x
        for _ in range(items):
            y = y * 1.0
        return y

    counter = OpCounter()
    loss = forward()
    with counter:
        loss.backward()
    both = _cpu_s(lambda: forward().backward(), repeats)  # a CPU backward runs on the calling thread
    return max(0.0, both - _cpu_s(forward, repeats)) / counter.total


def _gil_contention(items: int, repeats: int, threads: int) -> float:
    # threads that wait on each other: wall time, in calls short beside the scheduler's slice, repeated more
    loop = _op_loop(max(1, items // 10))
    repeats = max(repeats, SHORT_REPEATS)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="multigpu-calibrate") as pool:
        alone = quantile_s(lambda: pool.submit(loop).result(), repeats)
        together = quantile_s(lambda: [f.result() for f in [pool.submit(loop) for _ in range(threads)]], repeats)
    return together / (threads * alone)


def _views(
    tensors: Sequence[torch.Tensor], devices: Sequence[object], detach: bool = False
) -> list[list[torch.Tensor]]:
    return [[t.detach() for t in tensors] for _ in devices]


def _torch_replicate(module: nn.Module) -> object:
    torch_replicate = importlib.import_module("torch.nn.parallel.replicate")
    with mock.patch.object(torch_replicate, "_broadcast_coalesced_reshape", _views):
        return torch_replicate.replicate(module, [0])


_REPLICATES: dict[str, Callable[[nn.Module], object]] = {
    "torch": _torch_replicate,
    "multigpu": lambda module: build_replicas(module, [torch.device("cpu")]),
}


def _replicate_fn(which: str) -> Callable[[nn.Module], object]:
    message = "replicate={value!r} is not one of {choices}; pass one of them"
    return lookup(_REPLICATES, which, message, choices="'torch' (nn.DataParallel) or 'multigpu' (the engine)")


def _replicate_costs(items: int, repeats: int, which: str) -> tuple[float, float]:
    """(seconds per module, seconds per tensor) of one replica."""
    run = _replicate_fn(which)
    modules = nn.Sequential(*[nn.Identity() for _ in range(items)])
    per_module = _cpu_s(lambda: run(modules), repeats) / (items + 1)
    tensors = nn.ParameterList([nn.Parameter(torch.ones(1)) for _ in range(items)])
    with_tensors = _cpu_s(lambda: run(tensors), repeats)
    return per_module, max(0.0, with_tensors - per_module) / items


def _fsdp_group_s(groups: int, repeats: int) -> float | None:
    """Seconds of FSDP2's own work per group and step; None where a process group already exists."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from multigpu.planning.fsdp_probe_step import tiny_fsdp_step

    if not dist.is_available() or dist.is_initialized():
        return None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        # one process, no collective to wait on: the thread's CPU time
        extra = _cpu_s(tiny_fsdp_step(groups, mesh), repeats) - _cpu_s(tiny_fsdp_step(groups, None), repeats)
        return max(0.0, extra) / (groups + 1)  # the root is a group too
    finally:
        dist.destroy_process_group()


def fsdp_group_s(groups: int = 16, repeats: int = 7) -> float:
    """FSDP2's own seconds per group and step in this process (the development machine's figure
    where a process group already exists)."""
    measured = _fsdp_group_s(groups, repeats)
    return DEFAULT_HOST.fsdp_group_s if measured is None else measured


def measure_host_costs(
    *, items: int = 2000, repeats: int = 7, threads: int = 2, replicate: str = "multigpu", fsdp_groups: int = 16
) -> HostCosts:
    """This machine's host costs (seconds per item; ``launch_s`` 0: add a GPU's with ``.on_gpu()``).

    Args:
        items: ops, modules or tensors per probe.
        repeats: timed repeats per probe; the low quantile of the thread's CPU time is kept
            (the GIL probe: of the wall time, over at least ``SHORT_REPEATS`` calls a tenth as long).
        threads: threads for the GIL probe (at most the cores free for them).
        replicate: whose replicate to time: ``"multigpu"`` (the engine, as CPU replicas run it)
            or ``"torch"`` (nn.DataParallel's, as GPU replicas in public reports run it).
        fsdp_groups: groups of the fsdp probe (0: keep the development machine's figure).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # one-element ops: the intra-op pool would only add noise
    try:
        replicate_module_s, replicate_tensor_s = _replicate_costs(items, repeats, replicate)
        fsdp = _fsdp_group_s(fsdp_groups, repeats) if fsdp_groups else None
        return HostCosts(
            op_s=_cpu_s(_op_loop(items), repeats) / items,
            module_call_s=_module_call_s(items, repeats),
            backward_op_s=_backward_op_s(items, repeats),
            gil_contention=max(1.0 / threads, _gil_contention(items, repeats, threads)),
            replicate_module_s=replicate_module_s,
            replicate_tensor_s=replicate_tensor_s,
            fsdp_group_s=DEFAULT_HOST.fsdp_group_s if fsdp is None else fsdp,
            source=f"measured here (CPU time, 25th percentile of {repeats}, {items} items per probe, {replicate} replicate)",
        )
    finally:
        torch.set_num_threads(previous)


def memory_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 7) -> float:
    """Bytes/s of a large CPU copy on one thread (read + write counted): what each of ddp's processes and
    the DataParallel engine's reduce copy at, timed by the thread's CPU time."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return 2 * nbytes / _cpu_s(lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class ProbeRounds:
    """Seconds per round of :meth:`ReplicaProbe.interleaved`: wall time of one replica alone and of all at
    once, the CPU time of the replica's thread alone and the most any replica's thread took at once,
    and the wall time of the call timed beside them (empty without one)."""

    solo: list[float]
    together: list[float]
    solo_cpu: list[float]
    together_cpu: list[float]
    whole: list[float]


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

    def __init__(
        self,
        model: nn.Module,
        chunk: torch.Tensor,
        *,
        replicas: int = 2,
        loss_fn: LossFn = default_loss,
        intra_op: int | None = None,
    ):
        self._copies = [_sharing_copy(model) for _ in range(replicas)]
        self._chunk, self._loss_fn = chunk, loss_fn

        # intra_op: each replica thread's own intra-op thread count (None: the process's), as the
        # engine gives CPU replicas their share of the cores (parallel.threads)
        def init() -> None:
            if intra_op is not None:
                torch.set_num_threads(intra_op)

        self._pool = ThreadPoolExecutor(max_workers=replicas, thread_name_prefix="multigpu-probe", initializer=init)
        self._one_thread = (torch.get_num_threads() if intra_op is None else intra_op) == 1

    def _one(self, i: int) -> float:
        """One replica's forward and backward; the CPU seconds of the thread that ran it."""
        start = CPU_CLOCK()
        self._copies[i].zero_grad(set_to_none=True)
        self._loss_fn(self._copies[i](self._chunk)).backward()
        return CPU_CLOCK() - start

    def solo_cpu_s(self) -> float:
        """CPU seconds of one replica's call alone (its thread's)."""
        return self._pool.submit(self._one, 0).result()

    def rounds(self, rounds: int) -> tuple[list[float], list[float]]:
        """Per round, one replica alone then all at once (one call each, after a warm-up of both): the
        two lists of seconds, for a quantile (a change of load touches both)."""
        timed = self.interleaved(rounds)
        return timed.solo, timed.together

    def interleaved(self, rounds: int, whole: Callable[[], object] | None = None) -> ProbeRounds:
        """As :meth:`rounds`, with the replicas' thread CPU seconds, and ``whole`` (another call: the
        whole batch in this thread) timed third in each round, so that every list samples the same
        moments of the machine's load."""
        self._warm()
        if whole is not None:
            whole()
        timed = ProbeRounds([], [], [], [], [])
        for _ in range(rounds):
            start = time.perf_counter()
            timed.solo_cpu.append(self._pool.submit(self._one, 0).result())
            timed.solo.append(time.perf_counter() - start)
            start = time.perf_counter()
            timed.together_cpu.append(max(self._pool.map(self._one, range(len(self._copies)))))
            timed.together.append(time.perf_counter() - start)
            if whole is not None:
                start = time.perf_counter()
                whole()
                timed.whole.append(time.perf_counter() - start)
        return timed

    def _warm(self) -> None:
        self._pool.submit(self._one, 0).result()
        list(self._pool.map(self._one, range(len(self._copies))))

    def times(self, *, repeats: int = REPEATS) -> tuple[float, float]:
        """(one replica alone, all at once): forward + backward seconds, the low quantile of ``repeats``
        rounds of :meth:`interleaved`. With one intra-op thread per replica the replicas' thread CPU time
        (all at once: the slowest replica's), which other processes do not move; else the wall time."""
        timed = self.interleaved(repeats)
        if self._one_thread:
            return low_quantile(timed.solo_cpu), low_quantile(timed.together_cpu)
        return low_quantile(timed.solo), low_quantile(timed.together)

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
    device = device_seconds(solo_s, host_s)
    return max(1.0, (together_s - solo_s + device) / device)


def replica_contention(
    model: nn.Module,
    chunk: torch.Tensor,
    *,
    replicas: int = 2,
    loss_fn: LossFn = default_loss,
    rounds: int = REPEATS,
    host_s: float = 0.0,
) -> float:
    """How much slower one replica's device share runs while ``replicas`` run in threads.

    Solo and concurrent runs alternate over ``rounds``; each round's wall times go to
    :func:`device_contention` (a load that lasts a round slows both, and the ratio cancels it) and
    the rounds' median is kept (:data:`~multigpu.planning.timing.RATIO_QUANTILE`, as the CPU plan keeps it).
    """
    with ReplicaProbe(model, chunk, replicas=replicas, loss_fn=loss_fn) as probe:
        timed = probe.interleaved(rounds)
    contentions = [device_contention(s, t, host_s) for s, t in zip(timed.solo, timed.together)]
    return low_quantile(contentions, RATIO_QUANTILE)


def thread_handoff_s(repeats: int = 50) -> float:
    """Seconds to hand one task to a waiting pool thread and get its result back."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return quantile_s(lambda: pool.submit(threading.get_ident).result(), repeats)


def _collective_s(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    """A collective waits on the other processes: wall time, the second fastest of many short calls
    (:data:`~multigpu.planning.timing.WAIT_QUANTILE`: never faster than when every process holds a core)."""
    return quantile_s(fn, repeats, q=WAIT_QUANTILE, clock=clock)


def allreduce_busbw(
    nbytes: int, *, repeats: int = SHORT_REPEATS, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Bus bandwidth (bytes/s) of an all-reduce of ``nbytes`` float32 in the default process group.

    Every rank must call it (it runs collectives). busbw = nbytes / t * 2(n-1)/n (nccl-tests), t the
    :data:`~multigpu.planning.timing.WAIT_QUANTILE` of ``repeats`` wall times by ``clock``.
    """
    import torch.distributed as dist

    from multigpu.runtime.world import world_size

    world = world_size()
    tensor = torch.ones(max(1, nbytes // 4))
    seconds = _collective_s(lambda: dist.all_reduce(tensor), repeats, clock)
    return tensor.numel() * 4 / seconds * bus_factor("all-reduce", world)


def gather_busbw(
    group_bytes: Sequence[int], *, repeats: int = SHORT_REPEATS, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Bus bandwidth (bytes/s) of fsdp's collectives over groups of ``group_bytes`` (float32) each.

    Every rank must call it (it runs collectives). One step's worth, as FSDP2 issues them: an
    all-gather of every group, another of every group but the first (the root's, kept gathered),
    then a reduce-scatter of every group in reverse, each into buffers allocated for it (FSDP2
    allocates them anew every step; on a CPU the first touch of fresh memory is part of the cost).
    busbw = sum of S (n-1)/n over the time of the sequence (nccl-tests: busbw = algbw (n-1)/n for
    both, S the whole array), timed as :func:`allreduce_busbw` times its all-reduce.
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
    return moved / _collective_s(step, repeats, clock)


def _main() -> None:
    for which in ("torch", "multigpu"):
        host = measure_host_costs(replicate=which, repeats=15)
        print(f"-- replicate: {which}")
        for name in TIME_FIELDS:
            print(f"{name:20s} {getattr(host, name) * 1e6:8.2f} us")
        print(f"{'gil_contention':20s} {host.gil_contention:8.2f}")


if __name__ == "__main__":
    _main()
