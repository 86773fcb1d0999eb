"""A plan on this CPU: the model timed the way each strategy's processes will run it, on the machine's constants.

What ``multigpu advise`` measures of a factory model when it plans for this CPU (the machine's own
constants come from :mod:`multigpu.planning.machine`, cached):

- one replica's forward and backward at the batch one replica of the multi-device strategies
  runs, with the intra-op threads it gets there (the cores divided among the replicas: ``multigpu
  launch`` gives each of 2 processes on 2 cores one thread, DataParallel each replica thread its
  share; ``OMP_NUM_THREADS`` where the user set it, as the launcher then does), alone and with
  the other replicas at once (:class:`~multigpu.planning.calibrate.ReplicaProbe`):
  the per-sample compute and the contention;
- the whole batch in one process with every core (as ``single`` runs it: ``multigpu launch``
  gives one process all the cores): its speed-up over one replica's per-sample compute
  (:attr:`Platform.single_speedup`, more threads and a larger batch);
- the optimizer step, with one replica's threads;
- one replica's allocations of at least fsdp's mmap threshold in one step, and their bytes
  (:func:`~multigpu.planning.allocations.large_allocations`: what fsdp's processes map anew each step).

Batches too large to time in a fraction of a second are timed at a smaller batch and scaled
linearly. Each timing is the low quantile of :mod:`multigpu.planning.timing` (9 repeats, the 25th
percentile); the contention pairs solo and concurrent runs round by round and takes the quantile
of each. A fed-back ``compute_scale`` (:mod:`multigpu.planning.machine`) multiplies the compute.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from multigpu.devices.cpu import SHARDED_MMAP_THRESHOLD
from multigpu.planning.allocations import large_allocations
from multigpu.planning.calibrate import ReplicaProbe, device_contention
from multigpu.planning.costs import host_step_s
from multigpu.planning.counting import LossFn, build_optimizer, default_loss, device_seconds, measure_workload
from multigpu.planning.hardware import Platform
from multigpu.planning.machine import MachineConstants
from multigpu.planning.timing import REPEATS, low_quantile, quantile_s
from multigpu.planning.workload import Workload

COUNT_BATCH = 8  # samples of the counting step (host counts, bytes per sample)
MAX_PROBE_S = 0.25  # a timed call longer than this is timed at a smaller batch and scaled


@dataclass(frozen=True)
class CpuBatches:
    """What ``single`` runs (the whole batch) and what each of ``replicas`` replicas runs."""

    single: int
    replica: int
    replicas: int


def _threads(cores: int, replicas: int) -> int:
    """Intra-op threads of each of ``replicas`` processes, as ``multigpu launch`` sets them
    (``OMP_NUM_THREADS`` when the user set it, else the cores divided among the processes)."""
    from multigpu.runtime.world import configured_threads

    return configured_threads() or max(1, cores // max(1, replicas))


def _probe_batch(batch: int, per_sample_s: float) -> int:
    """``batch``, or fewer samples when ``batch`` would take longer than :data:`MAX_PROBE_S`."""
    if per_sample_s * batch <= MAX_PROBE_S:
        return batch
    return max(1, min(batch, int(MAX_PROBE_S / max(per_sample_s, 1e-12))))


def calibrate_cpu(
    model: nn.Module,
    inputs: Callable[[int], torch.Tensor],
    batches: CpuBatches,
    constants: MachineConstants,
    *,
    optimizer: str = "sgd-momentum",
    name: str = "model",
    loss_fn: LossFn = default_loss,
    cores: int | None = None,
) -> tuple[Workload, Platform]:
    """The workload of ``model`` and this CPU as its platform (``inputs(n)``: a batch of ``n`` samples)."""
    cores = cores or os.cpu_count() or 1
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(_threads(cores, batches.replicas))
        counted = measure_workload(
            model,
            inputs(min(COUNT_BATCH, batches.replica)),
            loss_fn=loss_fn,
            optimizer=optimizer,
            name=name,
            host=constants.host,
            repeats=3,
        )
        host_s = host_step_s(counted.counts, constants.host)
        rough = max(counted.compute_s_per_sample, 1e-9)

        replica_n = _probe_batch(batches.replica, rough)
        with ReplicaProbe(
            model,
            inputs(replica_n),
            replicas=max(2, batches.replicas),
            loss_fn=loss_fn,
            intra_op=_threads(cores, batches.replicas),
        ) as probe:
            solo_s, together_s = (low_quantile(t) for t in probe.rounds(REPEATS))
        per_sample = device_seconds(solo_s, host_s) / replica_n
        replica_x = inputs(replica_n)

        def replica_step() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(replica_x)).backward()

        replica_step()  # warm: lazily built state is not the step's
        large = large_allocations(replica_step, threshold=SHARDED_MMAP_THRESHOLD)
        opt = build_optimizer(optimizer, model)
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs(1))).backward()  # gradients for the optimizer to step on
        optimizer_s = quantile_s(opt.step)

        torch.set_num_threads(_threads(cores, 1))
        single_n = _probe_batch(batches.single, per_sample)
        x = inputs(single_n)

        def whole() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(x)).backward()

        single_per_sample = device_seconds(quantile_s(whole), host_s) / single_n
        model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(previous)
    scale = constants.value("compute_scale")
    w = replace(
        counted,
        compute_s_per_sample=per_sample * scale,
        optimizer_s=optimizer_s,
        large_allocations=large.count,
        large_allocation_bytes_per_sample=large.bytes / replica_n,
    )
    plat = constants.platform(
        cores=cores,
        contention=device_contention(solo_s, together_s, host_s),
        single_speedup=per_sample / single_per_sample,
    )
    return w, plat


def cpu_batches(
    devices: list[int],
    *,
    per_device_batch: int | None = None,
    global_batch: int | None = None,
    chunk_sizes: list[int] | None = None,
) -> CpuBatches:
    """The batches a plan over ``devices`` runs: the whole one, and one replica's at the most devices."""
    replicas = max(max(devices), 2)
    if chunk_sizes:
        return CpuBatches(sum(chunk_sizes), max(chunk_sizes), len(chunk_sizes))
    if global_batch is not None:
        return CpuBatches(global_batch, max(1, -(-global_batch // replicas)), replicas)
    batch = per_device_batch or 32
    return CpuBatches(batch, batch, replicas)
