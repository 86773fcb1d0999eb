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
- the optimizer step (and ``zero_grad``), with one replica's threads, each right after a backward as a
  training step runs it (:func:`optimizer_step_s`);
- one replica's allocations of at least fsdp's mmap threshold in one step, and their bytes
  (:func:`~multigpu.planning.allocations.large_allocations`: what fsdp's processes map anew each step).

Batches too large to time in a fraction of a second are timed at a smaller batch and scaled
linearly. Each timing is the low quantile of :mod:`multigpu.planning.timing` (9 repeats, the 25th
percentile); the contention pairs solo and concurrent runs round by round and takes the quantile
of each. A fed-back ``compute_scale`` (:mod:`multigpu.planning.machine`) multiplies the compute.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from multigpu.devices.cpu import SHARDED_MMAP_THRESHOLD
from multigpu.planning.allocations import large_allocations
from multigpu.planning.calibrate import ProbeRounds, ReplicaProbe, device_contention
from multigpu.planning.costs import host_step_s
from multigpu.planning.counting import (
    LossFn,
    build_optimizer,
    default_loss,
    device_seconds,
    measure_workload,
    optimizer_step_s,
)
from multigpu.planning.hardware import Platform
from multigpu.planning.left_as_found import left_as_found
from multigpu.planning.machine import MachineConstants
from multigpu.planning.timing import CPU_CLOCK, RATIO_QUANTILE, low_quantile
from multigpu.planning.workload import Workload

ROUNDS = (
    15  # rounds of the replica probe (alone, all at once, the whole batch): times at QUANTILE, ratios at their median
)
COUNT_BATCH = 8  # samples of the counting step (host counts, bytes per sample)
MAX_PROBE_S = 0.25  # a timed call longer than this is timed at a smaller batch and scaled


@dataclass(frozen=True)
class CpuBatches:
    """What ``single`` runs (the whole batch) and what each of ``replicas`` replicas runs."""

    single: int
    replica: int
    replicas: int


@dataclass(frozen=True)
class ReplicaRates:
    """What the replica probe's rounds give the plan (see :func:`replica_rates`)."""

    per_sample_s: float  # one replica's device seconds per sample, on its own threads
    contention: float  # s(N): its device share's slowdown beside the other replicas (>= 1)
    single_speedup: float  # s_1: the whole batch on every core, per sample, over one replica (>= 1)


def replica_rates(
    rounds: ProbeRounds, host_s: float, replica_n: int, single_n: int, *, replica_threads: int = 1
) -> ReplicaRates:
    """The per-sample compute, the contention and the one-process speed-up from the probe's rounds.

    - compute: the :data:`~multigpu.planning.timing.QUANTILE` of the replica's thread CPU time alone,
      less the host's share ``host_s``, over its ``replica_n`` samples (one intra-op thread: its CPU
      time is the step's quiet duration however loaded the machine; with ``replica_threads`` > 1 the
      other threads' work is not in it, and the wall time's quantile is taken);
    - contention and speed-up: ratios of wall times taken in the same round, the median of the rounds
      (:data:`~multigpu.planning.timing.RATIO_QUANTILE`). A load that lasts a round slows both of its timings, so the ratio
      cancels it; a quantile away from the median would not read a loaded machine better, it would
      bias the quiet machine's ratio by the rounds' spread (the 25th percentile of the contention and
      the 75th of the speed-up, kept before, predicted every strategy low: -3% to -38% on a quiet
      run). Each at least 1: on a quiet machine replicas never run faster together than alone, and
      every core on twice the batch never runs slower per sample than one.

    Example:
        >>> r = ProbeRounds(solo=[0.010] * 4, together=[0.012, 0.030, 0.013, 0.012],
        ...                 solo_cpu=[0.010] * 4, together_cpu=[0.011] * 4, whole=[0.011, 0.040, 0.012, 0.011])
        >>> rates = replica_rates(r, host_s=0.0, replica_n=10, single_n=20)
        >>> round(rates.per_sample_s, 6), rates.contention, round(rates.single_speedup, 3)
        (0.001, 1.2, 1.667)
    """
    solo = rounds.solo_cpu if replica_threads == 1 else rounds.solo
    per_sample = device_seconds(low_quantile(solo), host_s) / replica_n
    contentions = [device_contention(s, t, host_s) for s, t in zip(rounds.solo, rounds.together)]
    contention = low_quantile(contentions, RATIO_QUANTILE)
    speedups = [
        (device_seconds(s, host_s) / replica_n) / (device_seconds(w, host_s) / single_n)
        for s, w in zip(rounds.solo, rounds.whole)
    ]
    speedup = low_quantile(speedups, RATIO_QUANTILE) if speedups else 1.0
    return ReplicaRates(per_sample, max(1.0, contention), max(1.0, speedup))


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
    """The workload of ``model`` and this CPU as its platform (``inputs(n)``: a batch of ``n`` samples).

    ``model`` is left as it was found (:func:`~multigpu.planning.left_as_found.left_as_found`): the timed
    optimizer steps move its weights, the probe's batches run through its BatchNorm and dropout, and its
    gradients are set to None between steps; the CPU's random stream (``inputs`` may draw from it) too.
    """
    cores = cores or os.cpu_count() or 1
    previous = torch.get_num_threads()
    # the user's model is put back: weights, buffers, gradients, modes and the random stream
    with left_as_found(model, torch.device("cpu")):
        return _calibrated(model, inputs, batches, constants, optimizer, name, loss_fn, cores, previous)


def _calibrated(
    model: nn.Module,
    inputs: Callable[[int], torch.Tensor],
    batches: CpuBatches,
    constants: MachineConstants,
    optimizer: str,
    name: str,
    loss_fn: LossFn,
    cores: int,
    previous: int,
) -> tuple[Workload, Platform]:
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
        replica_threads, single_threads = _threads(cores, batches.replicas), _threads(cores, 1)
        with ReplicaProbe(
            model,
            inputs(replica_n),
            replicas=max(2, batches.replicas),
            loss_fn=loss_fn,
            intra_op=replica_threads,
        ) as probe:
            probe.times(repeats=1)  # warm: the first call builds what later ones reuse
            first_s = probe.solo_cpu_s() if replica_threads == 1 else probe.times(repeats=1)[0]
            single_n = _probe_batch(batches.single, device_seconds(first_s, host_s) / replica_n)
            x = inputs(single_n)

            def whole() -> None:
                # the whole batch with every core, as ``single`` runs it, in this thread between the replicas' calls
                torch.set_num_threads(single_threads)
                try:
                    model.zero_grad(set_to_none=True)
                    loss_fn(model(x)).backward()
                finally:
                    torch.set_num_threads(replica_threads)

            timed = probe.interleaved(ROUNDS, whole)
        rates = replica_rates(timed, host_s, replica_n, single_n, replica_threads=replica_threads)
        replica_x = inputs(replica_n)

        def replica_step() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(replica_x)).backward()

        replica_step()  # warm: lazily built state is not the step's
        large = large_allocations(replica_step, threshold=SHARDED_MMAP_THRESHOLD)
        # one intra-op thread: the thread's CPU time (other processes only keep it off the core)
        clock = CPU_CLOCK if replica_threads == 1 else time.perf_counter
        optimizer_s = optimizer_step_s(build_optimizer(optimizer, model), replica_step, clock=clock)
        model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(previous)
    scale = constants.value("compute_scale")
    w = replace(
        counted,
        compute_s_per_sample=rates.per_sample_s * scale,
        optimizer_s=optimizer_s,
        large_allocations=large.count,
        large_allocation_bytes_per_sample=large.bytes / replica_n,
    )
    plat = constants.platform(
        cores=cores,
        contention=rates.contention,
        single_speedup=rates.single_speedup,
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
