"""Per-step time of single device, DataParallel (``dp``), balanced DataParallel, DDP and FSDP: one equation each.

Every term is a byte count over a bandwidth, a per-sample compute time times a batch, or a host
count (:class:`~multigpu.planning.workload.StepCounts`) times a host cost
(:class:`~multigpu.planning.hardware.HostCosts`); the equations, their assumptions and their
sources are on one page: docs/planning.md. The host's share of a step::

    H_f = module_calls * t_call + forward_ops * t_op + forward_kernels * t_launch     (forward)
    H_b = backward_ops * t_bop + backward_kernels * t_launch                         (backward)
    R(N) = N * (modules * t_rmod + tensors * t_rten)                                 (replicate)
    H_fsdp = groups * t_group                                                        (fsdp's hooks)

``chain`` is the sum of host and device time on a CPU (an op runs on the thread that issues it),
the longer on a GPU; DataParallel's N forwards take turns on one GIL (``N sigma H_f``, sigma >= 1
measured), its backwards run in the autograd engine's threads. With ``F``/``K`` the device time
of forward / backward:

    single  T = h2d(b) + chain(H_f, F) + chain(H_b, K) + opt
    dp      T = h2d(B) + scatter + R(N) + broadcast(W) + max(chain(H_f, F_max), N sigma H_f)
                + chain(H_b, K_max) + gather(+grad) + reduce(G) + opt + threads
    ddp     T = h2d(b) + chain(H_f, F) + chain(H_b, K) + exposed_allreduce(G) + bucket copies + opt
                + t_ddp + broadcast(buffers)
    fsdp    T = h2d(b) + chain(H_f, F) + chain(H_b, K) + exposed(all-gathers, reduce-scatters)
                + copies + A t_map + b a t_page + opt / N

(``A``, ``a``: a replica's allocations per step at or above fsdp's mmap threshold on a CPU, and
their bytes per sample; ``t_map``, ``t_page``: what each costs there per allocation and per byte.)

Example:
    >>> from multigpu.planning.hardware import gpu, gpu_platform, link
    >>> from multigpu.planning.workload import from_preset
    >>> plat = gpu_platform(gpu("v100-32gb"), link("nvlink-v100"))
    >>> w = from_preset("resnet50", gpu("v100-32gb"))
    >>> step = predict_step("ddp", w, plat, devices=8, per_device_batch=32)
    >>> step.total_s > predict_step("single", w, plat, devices=1, per_device_batch=32).total_s
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from multigpu.core.lookup import lookup
from multigpu.errors import ConfigError
from multigpu.planning import memory
from multigpu.planning.hardware import HostCosts, Platform
from multigpu.planning.workload import StepCounts, Workload
from multigpu.profiling.bandwidth import bus_factor
from multigpu.strategies import multi_device_strategies, process_strategies, strategy_labels

# The strategies' names (dp-balanced: dp's variant, DataParallel with chunk sizes that even out memory).
# Their labels and how they run are asked of multigpu.strategies in PLANNED, at the end of this module:
# a name that is not a strategy's fails there, at import.
SINGLE, DP, DP_BALANCED, DDP, FSDP = "single", "dp", "dp-balanced", "ddp", "fsdp"

MIB = 2**20
DDP_BUCKET_BYTES = 25 * MIB  # torch DDP default bucket_cap_mb
DDP_FIRST_BUCKET_BYTES = 1 * MIB  # torch DDP's small first bucket


def forward_host_s(counts: StepCounts, host: HostCosts) -> float:
    """H_f: host seconds to issue one replica's forward and loss."""
    return (
        counts.module_calls * host.module_call_s
        + counts.forward_ops * host.op_s
        + counts.forward_kernels * host.launch_s
    )


def backward_host_s(counts: StepCounts, host: HostCosts) -> float:
    """H_b: host seconds to issue one replica's backward."""
    return counts.backward_ops * host.backward_op_s + counts.backward_kernels * host.launch_s


def host_step_s(counts: StepCounts, host: HostCosts) -> float:
    """H_f + H_b: host seconds of one replica's forward, loss and backward."""
    return forward_host_s(counts, host) + backward_host_s(counts, host)


def replicate_s(counts: StepCounts, host: HostCosts, replicas: int) -> float:
    """R(N): Python work of DataParallel's replicate, every step, for ``replicas`` replicas."""
    return replicas * (counts.modules * host.replicate_module_s + counts.tensors * host.replicate_tensor_s)


def chain(host_s: float, device_s: float, *, synchronous: bool) -> float:
    """One thread issuing ops that take ``device_s`` to run: the sum on a CPU, the longer on a GPU."""
    return host_s + device_s if synchronous else max(host_s, device_s)


def threaded_forward_s(counts: StepCounts, host: HostCosts, replicas: int, one_replica_s: float) -> float:
    """Forward of ``replicas`` threads sharing one GIL: the slowest replica, or the GIL's queue of turns."""
    if replicas <= 1:
        return one_replica_s
    return max(one_replica_s, replicas * host.gil_contention * forward_host_s(counts, host))


@dataclass(frozen=True)
class StepTime:
    """A predicted step: total seconds and where they go."""

    strategy: str
    devices: int
    chunks: tuple[int, ...]  # samples per device this step
    total_s: float
    parts: dict[str, float] = field(default_factory=dict)  # sums to total_s
    allreduce_total_s: float = 0.0  # DDP/FSDP: collective time before overlap (the parts hold what is exposed)

    @property
    def global_batch(self) -> int:
        return sum(self.chunks)

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.global_batch / self.total_s


def _copy_s(nbytes: float, plat: Platform) -> float:
    return nbytes / plat.link.copy_bandwidth if plat.peer_copies else 0.0


def _h2d_s(nbytes: float, plat: Platform) -> float:
    bandwidth = plat.input_bandwidth()
    return nbytes / bandwidth if bandwidth else 0.0


def _phases(w: Workload, plat: Platform, samples: int, replicas: int, hooks_s: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of one replica of ``samples``: host and device chained.

    ``hooks_s``: host work of a wrapper (fsdp's), half in each phase.
    """
    device = samples * w.compute_s_per_sample * plat.compute_slowdown(replicas)
    forward = chain(
        forward_host_s(w.counts, plat.host) + hooks_s / 2,
        device * (1 - w.backward_fraction),
        synchronous=plat.synchronous,
    )
    backward = chain(
        backward_host_s(w.counts, plat.host) + hooks_s / 2,
        device * w.backward_fraction,
        synchronous=plat.synchronous,
    )
    return forward, backward


def _optimizer_s(w: Workload, plat: Platform) -> float:
    return w.optimizer_s if w.optimizer_s is not None else w.optimizer_traffic_bytes() / plat.memory_bandwidth


def single_step(w: Workload, plat: Platform, chunks: Sequence[int]) -> StepTime:
    """One device, the whole batch."""
    b = sum(chunks)
    forward, backward = _phases(w, plat, b, 1)
    parts = {
        "inputs": _h2d_s(b * w.input_bytes_per_sample, plat),
        "forward": forward,
        "backward": backward,
        "optimizer": _optimizer_s(w, plat),
    }
    return StepTime(SINGLE, 1, (b,), sum(parts.values()), parts)


def dataparallel_step(w: Workload, plat: Platform, chunks: Sequence[int]) -> StepTime:
    """One process, a thread per replica: everything passes through the primary device."""
    n, batch = len(chunks), sum(chunks)
    away = batch - chunks[0]  # samples whose inputs and outputs cross the link
    gathered = away * w.output_bytes_per_sample * (1 if w.loss_on_replicas else 2)
    forward, backward = _phases(w, plat, max(chunks), n)
    parts = {
        "inputs": _h2d_s(batch * w.input_bytes_per_sample, plat),
        "scatter": _copy_s(away * w.input_bytes_per_sample, plat),
        "replicate": replicate_s(w.counts, plat.host, n),
        "broadcast": _copy_s(w.weight_bytes, plat),
        # the replicas' forwards take turns on the GIL; backward runs in the engine's C++ threads
        "forward": threaded_forward_s(w.counts, plat.host, n, forward),
        "backward": backward,
        "gather": _copy_s(gathered, plat),
        # NCCL/peer reduce moves the gradients once; the sums read two and write one per replica.
        "reduce": _copy_s(w.grad_bytes, plat) + (n - 1) * 3 * w.grad_bytes / plat.memory_bandwidth,
        "optimizer": _optimizer_s(w, plat),
        "threads": 2 * n * plat.thread_overhead_s,
    }
    return StepTime(DP, n, tuple(chunks), sum(parts.values()), parts)


def balanced_dataparallel_step(w: Workload, plat: Platform, chunks: Sequence[int]) -> StepTime:
    """DataParallel with chunk sizes that even out per-device memory (the primary takes fewer)."""
    sizes = memory.balanced_chunks(w, plat, len(chunks), sum(chunks))
    step = dataparallel_step(w, plat, sizes)
    return StepTime(DP_BALANCED, step.devices, step.chunks, step.total_s, step.parts)


def collective_s(kind: str, nbytes: float, devices: int, busbw: float) -> float:
    """Seconds of a ring ``all-reduce``, ``all-gather`` or ``reduce-scatter`` whose whole array is ``nbytes``.

    nccl-tests: algbw = busbw / factor, with factor 2(n-1)/n for all-reduce and (n-1)/n for the
    other two, S the size of the whole (gathered, or to-be-reduced) array; a link's bus bandwidth
    is the same for every ring collective.
    """
    if devices <= 1:
        return 0.0
    return nbytes * bus_factor(kind, devices) / busbw


def ddp_buckets(w: Workload) -> list[tuple[float, float]]:
    """(bytes, ready fraction of backward) per DDP bucket, in reduction order.

    Gradients arrive at a uniform rate over backward, the last layers' first; the parameters in
    ``last_ready_params`` (first layer, tied embeddings) are ready only at the end.
    """
    early = (w.params - w.last_ready_params) * 4
    buckets: list[tuple[float, float]] = []
    done, cap = 0.0, float(DDP_FIRST_BUCKET_BYTES)
    while done < early:
        size = min(cap, early - done)
        done += size
        buckets.append((size, done / early))
        cap = DDP_BUCKET_BYTES
    late = w.last_ready_params * 4
    if late:
        buckets.append((late, 1.0))
    return buckets


def exposed_allreduce_s(w: Workload, plat: Platform, devices: int, backward_s: float) -> tuple[float, float]:
    """(total all-reduce seconds, seconds not hidden behind backward) of DDP's bucketed all-reduce.

    Buckets are reduced one after another in a FIFO as they become ready; the ideal exposure is
    what runs past the end of backward; of the rest, a share ``1 - overlap`` is exposed too.
    """
    busbw = plat.allreduce_busbw(devices)
    clock = total = 0.0
    for nbytes, ready in ddp_buckets(w):
        seconds = collective_s("all-reduce", nbytes, devices, busbw) + (
            plat.collective_latency_s if devices > 1 else 0.0
        )
        clock = max(clock, ready * backward_s) + seconds
        total += seconds
    ideal = max(0.0, clock - backward_s)
    return total, ideal + (1.0 - plat.overlap) * (total - ideal)


def buffer_broadcast_s(w: Workload, plat: Platform, devices: int) -> float:
    """DDP's broadcast of rank 0's buffers before every forward (BatchNorm's running statistics): one
    coalesced broadcast (bus factor 1) and its latency; nothing without buffers or with one device."""
    if devices <= 1 or not w.buffer_bytes:
        return 0.0
    return plat.collective_latency_s + w.buffer_bytes / plat.allreduce_busbw(devices)


def ddp_step(w: Workload, plat: Platform, chunks: Sequence[int]) -> StepTime:
    """One process per device; gradients all-reduced in buckets, overlapped with backward."""
    n, b = len(chunks), max(chunks)
    forward, backward = _phases(w, plat, b, n)
    comm_total, exposed = exposed_allreduce_s(w, plat, n, backward)
    parts = {
        "inputs": _h2d_s(b * w.input_bytes_per_sample, plat),
        "forward": forward,
        "backward": backward,
        "allreduce": exposed,
        # DDP copies gradients into its bucket buffers and back (no gradient_as_bucket_view).
        "buckets": 2 * w.grad_bytes / plat.memory_bandwidth if n > 1 else 0.0,
        # DDP's reducer and hooks, and the processes meeting at the all-reduce (measured on a CPU, 0 elsewhere)
        "ddp": plat.ddp_step_s if n > 1 else 0.0,
        "buffers": buffer_broadcast_s(w, plat, n),
        "optimizer": _optimizer_s(w, plat),
    }
    return StepTime(DDP, n, tuple(chunks), sum(parts.values()), parts, allreduce_total_s=comm_total)


@dataclass(frozen=True)
class _Group:
    compute_f: float  # this group's share of forward seconds
    compute_b: float
    gather: float  # seconds of its all-gather
    reduce: float  # seconds of its reduce-scatter


def _fsdp_groups(w: Workload, plat: Platform, n: int, forward: float, backward: float) -> list[_Group]:
    """Per group, root first: compute shares (by parameters: an assumption) and collective seconds."""
    sizes = w.fsdp.resolved(w.params)
    busbw = plat.gather_busbw_at(n)
    gather, reduce = memory.fsdp_gather_bytes(w), memory.fsdp_reduce_bytes(w)
    latency = plat.gather_latency_s if n > 1 else 0.0
    # a group without parameters (a root whose every layer is in a block) issues no collective
    return [
        _Group(
            forward * u / w.params,
            backward * u / w.params,
            collective_s("all-gather", u * gather, n, busbw) + latency if u else 0.0,
            collective_s("reduce-scatter", u * reduce, n, busbw) + latency if u else 0.0,
        )
        for u in sizes
    ]


def fsdp_collectives(w: Workload) -> dict[str, int]:
    """The all-gathers and reduce-scatters one fsdp step issues per rank (what :func:`exposed_fsdp_s` times).

    Each group with parameters is gathered before its forward and again before its backward (when
    resharded after forward; the root's group never is: its backward follows at once) and its
    gradients reduce-scattered once.

    Example:
        >>> from multigpu.planning.workload import FsdpLayout
        >>> w = Workload(name="net", params=30, compute_s_per_sample=1e-3, fsdp=FsdpLayout(groups=(0, 10, 20)))
        >>> fsdp_collectives(w)  # an empty root: two blocks, each gathered twice
        {'all-gather': 4, 'reduce-scatter': 2}
    """
    sizes = w.fsdp.resolved(w.params)
    groups = [u for u in sizes if u]
    again = len(groups) - (1 if sizes[0] else 0) if w.fsdp.reshard_after_forward else 0
    return {"all-gather": len(groups) + again, "reduce-scatter": len(groups)}


def _gathered_by(link: float, issued: float, seconds: float) -> tuple[float, float]:
    """(link busy until, group ready at) for an all-gather issued at ``issued`` behind ``link``;
    a group with nothing to gather is ready at once and leaves the link as it is."""
    if seconds <= 0.0:
        return link, 0.0
    end = max(link, issued) + seconds
    return end, end


def _forward_clock(groups: Sequence[_Group]) -> float:
    """End of forward: each group computes once its all-gather is done; the next one's all-gather
    is issued as it starts (FSDP2's implicit prefetch), one collective at a time."""
    link, ready = _gathered_by(0.0, 0.0, groups[0].gather)
    compute = 0.0
    for i, g in enumerate(groups):
        start = max(compute, ready)
        if i + 1 < len(groups):
            link, ready = _gathered_by(link, start, groups[i + 1].gather)
        compute = start + g.compute_f
    return compute


def _backward_clock(groups: Sequence[_Group], regather: bool) -> float:
    """End of backward (reverse order, the root last): a block is gathered again (when resharded
    after forward; the next one prefetched as one starts), its gradients reduce-scattered when
    its backward ends; the step ends when the last reduce-scatter does."""
    order = list(reversed(groups))
    gather = [g.gather if regather and g is not groups[0] else 0.0 for g in order]
    link, ready = _gathered_by(0.0, 0.0, gather[0])
    compute = 0.0
    for i, g in enumerate(order):
        start = max(compute, ready)
        if i + 1 < len(order):
            link, ready = _gathered_by(link, start, gather[i + 1])
        compute = start + g.compute_b
        link = max(link, compute) + g.reduce
    return max(compute, link)


def exposed_fsdp_s(w: Workload, plat: Platform, devices: int, forward: float, backward: float) -> tuple[float, float]:
    """(total collective seconds, seconds not hidden behind compute) of one fsdp step.

    As for DDP: the ideal exposure ``X`` is what the one-at-a-time queue of collectives adds to
    forward and backward; of the rest, a share ``1 - overlap`` is exposed too.
    """
    groups = _fsdp_groups(w, plat, devices, forward, backward)
    regather = w.fsdp.reshard_after_forward
    total = sum(g.gather + g.reduce for g in groups) + sum(g.gather for g in groups[1:] if regather)
    ideal = max(0.0, _forward_clock(groups) - forward) + max(0.0, _backward_clock(groups, regather) - backward)
    ideal = min(ideal, total)
    return total, ideal + (1.0 - plat.overlap) * (total - ideal)


def fsdp_step(w: Workload, plat: Platform, chunks: Sequence[int]) -> StepTime:
    """One process per device, parameters sharded: each block all-gathered before its forward (and
    again before its backward), its gradients reduce-scattered; each rank steps its shard."""
    n, b = len(chunks), max(chunks)
    groups = w.fsdp.resolved(w.params)
    forward, backward = _phases(w, plat, b, n, hooks_s=len(groups) * plat.host.fsdp_group_s)
    comm_total, exposed = exposed_fsdp_s(w, plat, n, forward, backward)
    gather, reduce = memory.fsdp_gather_bytes(w), memory.fsdp_reduce_bytes(w)
    gathered = w.params + (w.params - groups[0] if w.fsdp.reshard_after_forward else 0)
    copy_bandwidth = plat.sharded_copy_bandwidth or plat.memory_bandwidth  # fresh buffers each step
    parts = {
        "inputs": _h2d_s(b * w.input_bytes_per_sample, plat),
        "forward": forward,
        "backward": backward,
        "collectives": exposed,
        # FSDP2 copies each gathered group out of its flat buffer into the parameters (read and
        # write) and each group's gradients into the reduce-scatter input (read p, write r).
        "copies": (2 * gather * gathered + (gather + reduce) * w.params) / copy_bandwidth if n > 1 else 0.0,
        # the step's own large buffers (activations, their gradients, kernels' workspaces), each
        # mapped anew under fsdp's malloc settings on a CPU: a mapping and a page fault per page
        "fresh memory": fresh_memory_s(w, plat, b),
        "optimizer": _optimizer_s(w, plat) / n,
    }
    return StepTime(FSDP, n, tuple(chunks), sum(parts.values()), parts, allreduce_total_s=comm_total)


SMALL_PAGE_BYTES = 2 << 20  # of a fresh allocation on 4 KiB pages: the rest sits on huge pages (see fresh_memory_s)


def fresh_memory_s(w: Workload, plat: Platform, samples: int) -> float:
    """Seconds one replica of ``samples`` spends mapping its step's large allocations anew (fsdp on a CPU).

    Each allocation pays the mapping, a page fault per 4 KiB page of its first :data:`SMALL_PAGE_BYTES`
    and the huge pages' rate for the rest: a mapping starts at a 4 KiB boundary, and the pages from there to
    the first 2 MiB boundary, and after the last one, cannot be huge (about 2 MiB in all). The allocations
    are taken at their mean size (the workload counts them and their bytes).

    Example:
        >>> from multigpu.planning.hardware import Platform, measured_link
        >>> plat = Platform(name="cpu", memory_bytes=None, memory_bandwidth=1e10, link=measured_link(1e9),
        ...                 fresh_byte_s=1e-9, fresh_huge_byte_s=0.25e-9)
        >>> w = Workload(name="net", params=1, compute_s_per_sample=1e-3, large_allocations=2,
        ...              large_allocation_bytes_per_sample=4 << 20)
        >>> round(fresh_memory_s(w, plat, 1) * 1e3, 3)  # two of 2 MiB: each on 4 KiB pages
        4.194
        >>> round(fresh_memory_s(w, plat, 4) * 1e3, 3)  # two of 8 MiB: 2 MiB at 1 ns a byte, 6 at 0.25
        7.34
    """
    if not w.large_allocations:
        return 0.0
    each = samples * w.large_allocation_bytes_per_sample / w.large_allocations
    on_small = min(each, SMALL_PAGE_BYTES)
    huge = plat.fresh_byte_s if plat.fresh_huge_byte_s is None else plat.fresh_huge_byte_s
    return w.large_allocations * (plat.fresh_alloc_s + on_small * plat.fresh_byte_s + (each - on_small) * huge)


@dataclass(frozen=True)
class PlannedStrategy:
    """What the planner knows of one strategy: its name, how it runs, its time and its memory."""

    name: str
    label: str  # in sentences and legends
    multi_device: bool  # False: the one-device baseline (it runs the whole batch)
    one_process: bool  # threads in one process: cannot span nodes
    step: Callable[[Workload, Platform, Sequence[int]], StepTime]
    memory: Callable[[Workload, Platform, Sequence[int]], list[float]]  # peak bytes per device
    feeds: str | None = None  # the machine constant its measured step solves (advise --measure's feedback)


def _planned(
    name: str,
    step: Callable[[Workload, Platform, Sequence[int]], StepTime],
    device_peaks: Callable[[Workload, Platform, Sequence[int]], list[float]],
    feeds: str | None = None,
) -> PlannedStrategy:
    """A row of the table: the strategy's own facts (:mod:`multigpu.strategies`) and the model's equations."""
    label = strategy_labels()[name]
    return PlannedStrategy(
        name, label, name in multi_device_strategies(), name not in process_strategies(), step, device_peaks, feeds
    )


PLANNED: dict[str, PlannedStrategy] = {
    s.name: s
    for s in (
        _planned(SINGLE, single_step, memory.single_memory, feeds="compute_scale"),
        _planned(DP, dataparallel_step, memory.dataparallel_memory, feeds="thread_overhead_s"),
        _planned(DP_BALANCED, balanced_dataparallel_step, memory.dataparallel_memory),
        _planned(DDP, ddp_step, memory.ddp_memory, feeds="allreduce_busbw"),
        _planned(FSDP, fsdp_step, memory.fsdp_memory, feeds="fsdp_group_s"),
    )
}


def _strategy(name: str) -> PlannedStrategy:
    return lookup(PLANNED, name, "strategy={value!r} is not one of {choices}; the planner has a row for each of them")


def device_memory(strategy: str, w: Workload, plat: Platform, chunks: Sequence[int]) -> list[float]:
    """Peak bytes on each device (index 0 is the primary for DataParallel); the equations: :mod:`memory`.

    Args:
        strategy: ``single``, ``dp``, ``dp-balanced``, ``ddp`` or ``fsdp``.
        w: the workload.
        plat: the platform (CUDA context per process, whether replicas copy weights).
        chunks: samples per device.
    """
    return _strategy(strategy).memory(w, plat, chunks)


def predict_step(
    strategy: str,
    w: Workload,
    plat: Platform,
    *,
    devices: int | None = None,
    per_device_batch: int | None = None,
    chunks: Sequence[int] | None = None,
) -> StepTime:
    """Predict one training step.

    Args:
        strategy: ``single``, ``dp``, ``dp-balanced``, ``ddp`` or ``fsdp`` (the Session's names).
        w: the workload (per-sample compute, sizes, host counts).
        plat: the devices and links.
        devices: how many devices (1 for ``single``), with ``per_device_batch`` samples each;
        per_device_batch: samples per device; the global batch is ``devices * per_device_batch``.
        chunks: instead of the two above, the samples of each device (``dp-balanced`` re-splits
            their sum; ``single`` runs their sum).

    Returns:
        The step's total seconds and their parts.

    Raises:
        ConfigError: an unknown strategy, a device count or batch below 1, or DataParallel across nodes.
    """
    planned = _strategy(strategy)
    sizes = list(chunks) if chunks is not None else [per_device_batch or 0] * (devices or 0)
    if not sizes or min(sizes) < 1:
        raise ConfigError(
            f"devices={devices}, per_device_batch={per_device_batch}, chunks={chunks}: every device needs "
            ">= 1 sample; pass devices >= 1 and per_device_batch >= 1, or chunks like [4, 19, 19, 18]"
        )
    if planned.multi_device and planned.one_process and not plat.single_process(len(sizes)):
        raise ConfigError(
            f"{strategy} runs in one process, so it cannot span {len(sizes)} devices over nodes of "
            f"{plat.devices_per_node}; use strategy='{DDP}'"
        )
    if not planned.multi_device:
        sizes = [sum(sizes)]
    return planned.step(w, plat, sizes)
