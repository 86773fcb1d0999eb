"""A plan on this CPU: the batches each strategy runs, the probe batch bound, and the calibration's own state."""

from __future__ import annotations

import time

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from multigpu.planning.calibrate import ProbeRounds
from multigpu.planning.cpu_plan import (
    MAX_PROBE_S,
    CpuBatches,
    _probe_batch,
    calibrate_cpu,
    cpu_batches,
    replica_rates,
)
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


def test_the_optimizer_step_of_one_intra_op_thread_is_timed_by_its_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # every optimizer step first waits 30 ms, as when other processes hold the core: not its CPU time
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # 2 cores, 2 replicas: one intra-op thread each
    waits = register_optimizer_step_pre_hook(lambda *_: time.sleep(0.03))
    try:
        w, _ = calibrate_cpu(build(), lambda n: torch.randn(n, 32), CpuBatches(16, 8, 2), fixed(), cores=2)
    finally:
        waits.remove()
    assert w.optimizer_s is not None and w.optimizer_s < 0.01


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


# --- the rates from the probe's rounds: fed timings, the formula (replica_rates) -----------------------------

# Four rounds of a replica of 10 samples and the whole batch of 20, 2 ms of host work per call. Round 2
# is loaded: wall times long, the replica's CPU time as in the quiet rounds.
ROUNDS = ProbeRounds(
    solo=[0.012, 0.012, 0.060, 0.013],
    together=[0.014, 0.017, 0.150, 0.015],
    solo_cpu=[0.012, 0.0121, 0.0125, 0.012],
    together_cpu=[0.013] * 4,
    whole=[0.0140, 0.0145, 0.400, 0.0142],
)


def test_the_compute_is_the_low_quantile_of_the_replicas_cpu_time_less_the_host() -> None:
    rates = replica_rates(ROUNDS, host_s=0.002, replica_n=10, single_n=20)
    assert rates.per_sample_s == pytest.approx((0.012 - 0.002) / 10)  # the loaded round's wall time is not read
    walls = replica_rates(ROUNDS, host_s=0.002, replica_n=10, single_n=20, replica_threads=2)
    assert walls.per_sample_s == pytest.approx((0.012 - 0.002) / 10)  # several threads: the wall time's quantile


def test_contention_and_speedup_are_the_median_of_ratios_within_a_round() -> None:
    rates = replica_rates(ROUNDS, host_s=0.002, replica_n=10, single_n=20)
    # per round: (together - solo + device) / device = 1.2, 1.5, 2.55, 1.18: the median (the lower middle)
    assert rates.contention == pytest.approx((0.014 - 0.012 + 0.010) / 0.010)
    # per round: (solo - host) / 10 over (whole - host) / 20 = 1.67, 1.6, 0.29, 1.80: the median
    assert rates.single_speedup == pytest.approx((0.010 / 10) / (0.0125 / 20))


def test_a_quiet_machines_spread_does_not_bias_the_ratios() -> None:
    # rounds spread evenly around a contention of 1.2 and a speed-up of 1.6 (no load: noise both ways);
    # the 25th percentile of the one and the 75th of the other read 1.1 and 1.8: every plan low
    rounds = ProbeRounds(
        solo=[0.010] * 5,
        together=[0.011, 0.012, 0.013, 0.0115, 0.0125],
        solo_cpu=[0.010] * 5,
        together_cpu=[0.010] * 5,
        whole=[20 / 10 * 0.010 / s for s in (1.4, 1.5, 1.6, 1.7, 1.8)],
    )
    rates = replica_rates(rounds, host_s=0.0, replica_n=10, single_n=20)
    assert rates.contention == pytest.approx(1.2)
    assert rates.single_speedup == pytest.approx(1.6)


def test_load_never_makes_replicas_faster_together_or_every_core_slower_than_one() -> None:
    loaded = ProbeRounds(
        solo=[0.010] * 3, together=[0.009] * 3, solo_cpu=[0.010] * 3, together_cpu=[0.010] * 3, whole=[0.05] * 3
    )
    rates = replica_rates(loaded, host_s=0.0, replica_n=10, single_n=20)
    assert (rates.contention, rates.single_speedup) == (1.0, 1.0)


def test_the_probe_times_the_whole_batch_in_each_round_beside_the_replicas() -> None:
    from torch import nn

    from multigpu.planning.calibrate import ReplicaProbe

    whole_calls: list[int] = []
    with ReplicaProbe(nn.Linear(16, 16), torch.randn(8, 16)) as probe:
        timed = probe.interleaved(3, lambda: whole_calls.append(1))
    assert len(whole_calls) == 4  # one warm-up, then one per round
    assert [len(v) for v in (timed.solo, timed.together, timed.solo_cpu, timed.together_cpu, timed.whole)] == [3] * 5
    # a replica's thread cannot spend more CPU time than the wall time its call took (one intra-op thread here)
    assert all(0 < cpu <= wall * 1.05 + 1e-4 for cpu, wall in zip(timed.solo_cpu, timed.solo))


def test_the_optimizer_is_timed_as_a_step_runs_it_each_time_after_a_backward() -> None:
    from torch import nn

    from multigpu.planning.counting import build_optimizer, optimizer_step_s

    model = nn.Linear(8, 2)
    opt = build_optimizer("sgd-momentum", model)
    x = torch.randn(4, 8)
    seen: list[bool] = []

    def backward() -> None:
        seen.append(model.weight.grad is None)  # the last step's zero_grad(set_to_none=True) ran
        model(x).square().mean().backward()

    ticks = iter([0.0, 100.0, 100.0, 101.0, 101.0, 103.0, 103.0, 106.0, 106.0, 110.0, 110.0, 115.0])
    # one warm-up step (100 s: the state's first) and five timed ones of 1..5 s: the 25th percentile is 2
    assert optimizer_step_s(opt, backward, repeats=5, clock=lambda: next(ticks)) == 2.0
    assert seen == [True] * 6 and model.weight.grad is None
    assert opt.state[model.weight]["momentum_buffer"] is not None  # it stepped


def test_the_calibration_leaves_the_users_model_and_the_random_stream_as_it_found_them() -> None:
    # calibrate_cpu times the optimizer on the model it is given (the weights moved), runs the whole batch and
    # one replica's on it (BatchNorm's statistics counted them, dropout drew), and left its gradients None
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4)
    )
    model[3].weight.requires_grad_(False)  # a frozen parameter stays frozen
    model(torch.randn(4, 32)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [(p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
    rng = torch.get_rng_state()
    calibrate_cpu(model, lambda n: torch.randn(n, 32), CpuBatches(8, 4, 2), fixed(), cores=2)
    after = model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    for p, (grad, value) in zip(model.parameters(), grads):
        assert p.grad is grad and (grad is None or torch.equal(grad, value))
    assert not model[3].weight.requires_grad and model.training
    assert torch.equal(torch.get_rng_state(), rng)
