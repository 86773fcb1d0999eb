"""A plan on this CPU: the batches each strategy runs, the probe batch bound, and the calibration's own state."""

from __future__ import annotations

import pytest
import torch

from multigpu.planning.cpu_plan import MAX_PROBE_S, CpuBatches, _probe_batch, calibrate_cpu, cpu_batches
from tests.planning._tiny_model import build
from tests.planning.machine_constants import fixed


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"global_batch": 512}, CpuBatches(512, 256, 2)),  # single the whole batch, each of 2 replicas half
        ({"global_batch": 7}, CpuBatches(7, 4, 2)),  # the larger share of an odd split
        ({"per_device_batch": 32}, CpuBatches(32, 32, 2)),
        ({"chunk_sizes": [4, 19, 19, 18]}, CpuBatches(60, 19, 4)),
    ],
)
def test_each_strategy_is_timed_at_the_batch_it_runs(flags: dict, expected: CpuBatches) -> None:
    assert cpu_batches([1, 2], **flags) == expected


def test_a_batch_too_long_to_time_is_timed_smaller() -> None:
    assert _probe_batch(64, 1e-3) == 64
    assert _probe_batch(1000, 1e-3) == int(MAX_PROBE_S / 1e-3)
    assert _probe_batch(1000, 10.0) == 1  # one sample longer than the bound: one sample


def test_the_calibration_puts_the_thread_count_back_and_builds_on_the_machine_constants() -> None:
    before = torch.get_num_threads()
    constants = fixed()
    inputs = lambda n: torch.randn(n, 32)  # noqa: E731
    w, plat = calibrate_cpu(build(), inputs, CpuBatches(16, 8, 2), constants, cores=2)
    assert torch.get_num_threads() == before
    assert plat.contention >= 1.0 and plat.single_speedup > 0 and plat.cores == 2
    assert plat.collective_latency_s == constants.allreduce_latency_s
    assert plat.sharded_copy_bandwidth == constants.fresh_copy_bandwidth
    assert w.params == 32 * 64 + 64 + 64 * 4 + 4 and w.optimizer_s is not None and w.compute_s_per_sample > 0
    assert w.counts.module_calls == 4 and w.counts.tensors == 4  # counted, as a GPU plan counts it


def test_the_calibration_counts_one_replicas_large_allocations_at_the_replicas_batch() -> None:
    from multigpu.devices.cpu import SHARDED_MMAP_THRESHOLD
    from multigpu.planning.allocations import large_allocations
    from tests.planning._reference_nets import small_cnn

    model = small_cnn()
    inputs = lambda n: torch.randn(n, 3, 32, 32)  # noqa: E731
    w, plat = calibrate_cpu(
        model, inputs, CpuBatches(32, 16, 2), fixed(fresh_alloc_s=2e-5, fresh_byte_s=1e-10), cores=2
    )
    x = inputs(16)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # a replica's share of 2 cores, as the calibration counted it
    try:
        step()
        seen = large_allocations(step, threshold=SHARDED_MMAP_THRESHOLD)
    finally:
        torch.set_num_threads(previous)
    assert w.large_allocations == seen.count > 10
    assert w.large_allocation_bytes_per_sample * 16 == pytest.approx(seen.bytes, rel=0.05)
    assert (plat.fresh_alloc_s, plat.fresh_byte_s) == (2e-5, 1e-10)  # the machine's, for fsdp's step
