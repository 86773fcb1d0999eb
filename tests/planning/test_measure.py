from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from multigpu.errors import ConfigError
from multigpu.planning.calibrate import ReplicaProbe, memory_bandwidth, replica_contention
from multigpu.planning.counting import device_seconds, measure_workload
from tests.launching import multigpu_launch


def test_measure_workload_counts_parameters_inputs_outputs_and_saved_activations() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    x = torch.randn(32, 64)
    w = measure_workload(model, x, repeats=3)
    assert w.params == 64 * 128 + 128 + 128 * 8 + 8
    assert w.input_bytes_per_sample == 64 * 4
    assert w.output_bytes_per_sample == 8 * 4
    # Saved for backward beyond the input and weights: the ReLU output (its mask source) and the
    # second Linear's input are the same tensor, counted once; the first Linear's output is
    # saved too (ReLU's input) unless fused; so 128 floats per sample at least, 2x128 at most.
    assert 128 * 4 <= w.activation_bytes_per_sample <= 2 * 128 * 4 + 8 * 4
    assert w.compute_s_per_sample > 0 and w.optimizer_s is not None and w.optimizer_s > 0
    assert w.counts.modules == 4 and w.counts.module_calls == 4 and w.counts.tensors == 4


def test_host_share_is_taken_out_of_the_timed_step_with_a_floor() -> None:
    assert device_seconds(1.0, 0.25) == pytest.approx(0.75)
    assert device_seconds(1.0, 0.0) == pytest.approx(1.0)
    # host costs measured on a busy machine can exceed the step: the device keeps a tenth
    assert device_seconds(1.0, 5.0) == pytest.approx(0.1)


def test_cpu_probes_return_plausible_values() -> None:
    assert memory_bandwidth(nbytes=8 * 2**20, repeats=3) > 1e8  # > 0.1 GB/s on any machine
    assert replica_contention(nn.Linear(256, 256), torch.randn(64, 256), rounds=1) >= 1.0
    with ReplicaProbe(nn.Linear(8, 8), torch.randn(4, 8)) as probe:
        solo, together = probe.times(repeats=1)
    assert solo > 0 and together > 0


def _sleeping_loss(output: torch.Tensor) -> torch.Tensor:
    # the sleep stands for the time other processes hold the core: wall time sees it, the thread's CPU time not
    time.sleep(0.03)
    return output.square().mean()


def test_a_one_thread_cpu_step_is_timed_by_its_cpu_time_and_a_threaded_one_by_its_wall_time() -> None:
    model, x = nn.Linear(16, 4), torch.randn(8, 16)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = measure_workload(model, x, loss_fn=_sleeping_loss, repeats=3)
        torch.set_num_threads(2)
        two = measure_workload(model, x, loss_fn=_sleeping_loss, repeats=3)
    finally:
        torch.set_num_threads(previous)
    assert one.compute_s_per_sample * 8 < 0.01  # a tiny Linear's CPU time, not the 30 ms it waited
    assert two.compute_s_per_sample * 8 >= 0.003  # the wall time, the wait in it (a tenth kept at least)


@pytest.mark.parametrize(("intra_op", "waited"), [(1, False), (2, True)])
def test_the_replica_probe_reads_its_threads_cpu_time_with_one_intra_op_thread(intra_op: int, waited: bool) -> None:
    previous = torch.get_num_threads()  # the replica threads set the process's intra-op threads
    try:
        with ReplicaProbe(nn.Linear(16, 4), torch.randn(8, 16), loss_fn=_sleeping_loss, intra_op=intra_op) as probe:
            solo, together = probe.times(repeats=3)
    finally:
        torch.set_num_threads(previous)
    assert (solo >= 0.03, together >= 0.03) == (waited, waited)


def test_empty_batch_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"inputs of shape \(0, 4\) hold no batch"):
        measure_workload(nn.Linear(4, 2), torch.randn(0, 4))


@pytest.mark.cuda
def test_measure_workload_on_a_cuda_device() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    w = measure_workload(model, torch.randn(64, 256, device="cuda"), repeats=3)
    assert w.params == 256 * 256 + 256 * 10 + 256 + 10
    assert w.compute_s_per_sample > 0 and w.activation_bytes_per_sample >= 256 * 4


@pytest.mark.cuda
def test_measure_workload_on_a_cuda_device_leaves_the_model_and_its_random_stream_as_they_were() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.BatchNorm1d(64)).cuda()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stream = torch.cuda.get_rng_state()
    measure_workload(model, torch.randn(32, 64, device="cuda"), repeats=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.cuda.get_rng_state(), stream)  # the dropout drew from a forked stream


_GATHER_BUSBW = """
import itertools
import sys
from pathlib import Path

from multigpu.planning.calibrate import allreduce_busbw, gather_busbw
from multigpu.session import Session


def clock():  # a fake wall clock: 25 timed calls of 1 ms (a clock hiccup), 10 ms, then 50 ms (load)
    durations = [0.050] * 11 + [0.001] + [0.050] * 5 + [0.010] + [0.050] * 7
    ticks = itertools.chain.from_iterable((i, i + d) for i, d in enumerate(durations))
    return lambda: next(ticks)


with Session(strategy="ddp", timeout_s=60) as session:
    value = gather_busbw([4_000, 200_000, 400_000], repeats=2)
    faked = [allreduce_busbw(4_000, clock=clock()), gather_busbw([4_000, 200_000, 400_000], clock=clock())]
    Path(sys.argv[1], f"rank{session.global_rank}").write_text(repr([value, *faked]))
"""


@pytest.mark.multiprocess
def test_fsdp_collectives_bandwidth_over_two_gloo_processes(tmp_path: Path) -> None:
    script = tmp_path / "gather_busbw.py"
    script.write_text(_GATHER_BUSBW)
    done = multigpu_launch("--strategy", "ddp", "--nproc-per-node", "2", str(script), str(tmp_path), timeout_s=120)
    assert done.returncode == 0, done.stderr[-3000:]
    values = [ast.literal_eval((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    assert all(0 < v[0] < 1e13 for v in values)  # bytes/s: positive and finite, below 10 TB/s on loopback
    # the faked clock's second fastest call, 10 ms: 4000 bytes x 2(n-1)/n; the groups' shards of 500, 25000
    # and 50000 floats gathered, all but the first again, and reduce-scattered, 8 bytes each x (n-1)/n
    for _, allreduce, gather in values:
        assert allreduce == pytest.approx(4000 * 1.0 / 0.010)
        assert gather == pytest.approx((75_500 + 75_000 + 75_500) * 8 * 0.5 / 0.010)


def test_fsdp_collectives_need_two_processes() -> None:
    import torch.distributed as dist

    from multigpu.planning.calibrate import gather_busbw

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"world_size=1, groups \[400\]: fsdp's collectives need at least 2"):
            gather_busbw([400])
    finally:
        dist.destroy_process_group()
