from __future__ import annotations

from dataclasses import replace

import pytest

from multigpu.errors import ConfigError
from multigpu.planning import costs, hardware, workload
from multigpu.planning.costs import collective_s, predict_step
from multigpu.planning.hardware import HostCosts, Platform, gpu_platform
from multigpu.planning.workload import StepCounts, Workload
from tests.planning._platforms import two_core_cpu


def _plat(link: str = "nvlink-v100", overlap: float = 0.5) -> Platform:
    return gpu_platform(hardware.gpu("v100-32gb"), hardware.link(link), overlap=overlap)


def _work(**kw: object) -> Workload:
    base: dict[str, object] = dict(name="m", params=50_000_000, compute_s_per_sample=2e-3, output_bytes_per_sample=1e6)
    base.update(kw)
    return Workload(**base)  # type: ignore[arg-type]


def test_ring_allreduce_follows_nccl_tests_bus_bandwidth() -> None:
    # busbw = algbw * 2(n-1)/n, so t = S * 2(n-1)/n / busbw; one device moves nothing.
    assert collective_s("all-reduce", 1e9, 2, 10e9) == pytest.approx(0.1)
    assert collective_s("all-reduce", 1e9, 8, 10e9) == pytest.approx(0.175)
    assert collective_s("all-reduce", 1e9, 1, 10e9) == 0.0


def test_single_step_is_compute_plus_optimizer() -> None:
    w = _work(optimizer="adam")
    step = predict_step("single", w, _plat(), devices=1, per_device_batch=32)
    assert step.parts["forward"] + step.parts["backward"] == pytest.approx(32 * 2e-3)
    assert step.parts["backward"] == pytest.approx(32 * 2e-3 * 2 / 3)
    assert step.parts["optimizer"] == pytest.approx(50e6 * 28 / 900e9)
    assert step.total_s == pytest.approx(sum(step.parts.values()))


def test_gpu_host_time_hides_behind_device_time_until_it_is_longer() -> None:
    # 1000 forward ops at 10 us + 5 us launch = 15 ms of host time per forward.
    counts = StepCounts(forward_ops=1000, forward_kernels=1000)
    host = HostCosts(
        op_s=1e-5,
        module_call_s=0.0,
        backward_op_s=0.0,
        gil_contention=1.0,
        replicate_module_s=0.0,
        replicate_tensor_s=0.0,
    )
    plat = replace(_plat(), host=host.on_gpu(5e-6))
    long = predict_step("single", _work(counts=counts), plat, devices=1, per_device_batch=32)
    assert long.parts["forward"] == pytest.approx(32 * 2e-3 / 3)  # 21 ms on the device: host hidden
    short = predict_step("single", _work(counts=counts), plat, devices=1, per_device_batch=4)
    assert short.parts["forward"] == pytest.approx(1000 * 15e-6)  # 2.7 ms on the device: host-bound


def test_cpu_host_time_adds_to_compute() -> None:
    counts = StepCounts(forward_ops=100, backward_ops=200)
    host = HostCosts(
        op_s=1e-5,
        module_call_s=0.0,
        backward_op_s=2e-5,
        gil_contention=1.0,
        replicate_module_s=0.0,
        replicate_tensor_s=0.0,
    )
    plat = Platform(
        name="cpu",
        memory_bytes=None,
        memory_bandwidth=10e9,
        link=hardware.measured_link(1e9),
        peer_copies=False,
        synchronous=True,
        host=host,
    )
    step = predict_step("single", _work(counts=counts), plat, devices=1, per_device_batch=3)
    assert step.parts["forward"] == pytest.approx(100 * 1e-5 + 3 * 2e-3 / 3)
    assert step.parts["backward"] == pytest.approx(200 * 2e-5 + 3 * 2e-3 * 2 / 3)


def test_dataparallel_pays_replicate_and_a_gil_queue_of_forwards() -> None:
    counts = StepCounts(modules=100, tensors=300, forward_ops=2000, forward_kernels=1500, module_calls=100)
    host = HostCosts(
        op_s=5e-6,
        module_call_s=2e-6,
        backward_op_s=5e-6,
        gil_contention=1.25,
        replicate_module_s=2e-5,
        replicate_tensor_s=5e-6,
    )
    plat = replace(_plat(), host=host.on_gpu(5e-6))
    w = _work(counts=counts, compute_s_per_sample=1e-5)  # tiny compute: the host decides
    dp = predict_step("dp", w, plat, devices=4, per_device_batch=32)
    h_f = 100 * 2e-6 + 2000 * 5e-6 + 1500 * 5e-6
    assert dp.parts["replicate"] == pytest.approx(4 * (100 * 2e-5 + 300 * 5e-6))
    assert dp.parts["forward"] == pytest.approx(4 * 1.25 * h_f)  # four replicas take turns on one GIL
    ddp = predict_step("ddp", w, plat, devices=4, per_device_batch=32)
    assert ddp.parts["forward"] == pytest.approx(h_f)  # a process each: no queue
    single = predict_step("single", w, plat, devices=1, per_device_batch=32)
    assert dp.throughput < single.throughput < ddp.throughput  # DataParallel below one device


def test_ddp_exposes_at_least_the_last_bucket_and_at_most_everything() -> None:
    w = _work(last_ready_params=10_000_000)
    for overlap in (0.0, 0.5, 1.0):
        step = predict_step("ddp", w, _plat("pcie3", overlap), devices=4, per_device_batch=32)
        total = step.allreduce_total_s
        assert step.total_s == pytest.approx(sum(step.parts.values()))
        last = collective_s("all-reduce", 10_000_000 * 4, 4, hardware.link("pcie3").allreduce_busbw)
        assert last <= step.parts["allreduce"] + 1e-12 <= total + 1e-12
    none = predict_step("ddp", w, _plat("pcie3", 0.0), devices=4, per_device_batch=32)
    assert none.parts["allreduce"] == pytest.approx(none.allreduce_total_s)


def test_ddp_buckets_cover_every_gradient_with_a_small_first_bucket() -> None:
    w = _work(last_ready_params=1_000)
    buckets = costs.ddp_buckets(w)
    assert sum(b for b, _ in buckets) == pytest.approx(w.grad_bytes)
    assert buckets[0][0] == costs.DDP_FIRST_BUCKET_BYTES
    assert max(b for b, _ in buckets[:-1]) <= costs.DDP_BUCKET_BYTES
    assert [r for _, r in buckets] == sorted(r for _, r in buckets) and buckets[-1][1] == 1.0


def test_dataparallel_pays_for_the_primary_and_ddp_does_not() -> None:
    w = _work(output_bytes_per_sample=20e6)
    dp = predict_step("dp", w, _plat("pcie3"), devices=4, per_device_batch=32)
    ddp = predict_step("ddp", w, _plat("pcie3"), devices=4, per_device_batch=32)
    assert dp.parts["broadcast"] == pytest.approx(w.weight_bytes / hardware.link("pcie3").copy_bandwidth)
    # three quarters of the batch's outputs cross to the primary, and their gradients come back
    assert dp.parts["gather"] == pytest.approx(96 * 20e6 * 2 / hardware.link("pcie3").copy_bandwidth)
    assert ddp.total_s < dp.total_s


def test_loss_on_replicas_halves_the_gather() -> None:
    plat = _plat("pcie3")
    with_grad = predict_step("dp", _work(), plat, devices=2, per_device_batch=8).parts["gather"]
    without = predict_step("dp", _work(loss_on_replicas=True), plat, devices=2, per_device_batch=8).parts["gather"]
    assert without == pytest.approx(with_grad / 2)


def test_cpu_replicas_copy_nothing_and_slow_each_other() -> None:
    plat = two_core_cpu(contention=1.2)
    dp = predict_step("dp", _work(), plat, devices=2, per_device_batch=16)
    assert dp.parts["broadcast"] == dp.parts["gather"] == dp.parts["scatter"] == 0.0
    assert dp.parts["forward"] + dp.parts["backward"] == pytest.approx(16 * 2e-3 * 1.2)
    assert plat.compute_slowdown(4) == pytest.approx(2.4)  # twice the replicas of cores


def test_balanced_dataparallel_gives_the_primary_fewer_samples() -> None:
    w = workload.from_preset("gpt2-124m", hardware.gpu("titan-rtx"))
    step = predict_step("dp-balanced", w, _plat(), devices=2, per_device_batch=8)
    assert step.chunks[0] < step.chunks[1] and sum(step.chunks) == 16


def test_explicit_chunks_are_planned_as_given() -> None:
    step = predict_step("dp", _work(), _plat(), chunks=[4, 19, 19, 18])
    assert step.chunks == (4, 19, 19, 18) and step.devices == 4
    assert predict_step("single", _work(), _plat(), chunks=[4, 19, 19, 18]).chunks == (60,)


def test_ddp_across_nodes_uses_the_network() -> None:
    plat = gpu_platform(
        hardware.gpu("v100-32gb"), hardware.link("nvlink-v100"), network=hardware.link("ib-hdr"), devices_per_node=8
    )
    assert plat.allreduce_busbw(8) == hardware.link("nvlink-v100").allreduce_busbw
    assert plat.allreduce_busbw(16) == hardware.link("ib-hdr").allreduce_busbw


def test_bad_requests_say_what_to_do() -> None:
    plat = gpu_platform(
        hardware.gpu("v100-32gb"), hardware.link("nvlink-v100"), network=hardware.link("ib-hdr"), devices_per_node=8
    )
    with pytest.raises(ConfigError, match=r"strategy='pipeline' is not one of single, dp, dp-balanced, ddp, fsdp"):
        predict_step("pipeline", _work(), plat, devices=2, per_device_batch=4)
    with pytest.raises(
        ConfigError, match=r"devices=0, per_device_batch=4, chunks=None: every device needs >= 1 sample"
    ):
        predict_step("ddp", _work(), plat, devices=0, per_device_batch=4)
    with pytest.raises(ConfigError, match=r"chunks=\[4, 0\]: every device needs >= 1 sample"):
        predict_step("dp", _work(), plat, chunks=[4, 0])
    with pytest.raises(ConfigError, match=r"cannot span 16 devices over nodes of 8; use strategy='ddp'"):
        predict_step("dp", _work(), plat, devices=16, per_device_batch=4)
    assert predict_step("fsdp", _work(), plat, devices=16, per_device_batch=4).devices == 16  # processes span nodes
    with pytest.raises(ConfigError, match=r"overlap=1.5 must be within \[0, 1\]"):
        gpu_platform(hardware.gpu("t4"), hardware.link("pcie3"), overlap=1.5)
    with pytest.raises(ConfigError, match=r"compute_s_per_sample=0 must be > 0; measure it"):
        _work(compute_s_per_sample=0)
    with pytest.raises(ConfigError, match=r"optimizer='lion' is not one of"):
        _work(optimizer="lion")


def test_ddp_on_a_cpu_pays_its_measured_step_floor_and_broadcasts_the_buffers_each_forward() -> None:
    plat = two_core_cpu(synchronous=True, collective_latency_s=2e-4, ddp_step_s=5e-4)
    plain = predict_step("ddp", _work(), plat, devices=2, per_device_batch=16)
    assert plain.parts["ddp"] == 5e-4 and plain.parts["buffers"] == 0.0  # no buffers: nothing broadcast
    bn = predict_step("ddp", _work(buffer_bytes=4e6), plat, devices=2, per_device_batch=16)
    assert bn.parts["buffers"] == pytest.approx(2e-4 + 4e6 / 1e9)  # one coalesced broadcast: latency + S / busbw
    assert bn.total_s - plain.total_s == pytest.approx(bn.parts["buffers"])
    one = predict_step("ddp", _work(buffer_bytes=4e6), plat, devices=1, per_device_batch=16)
    assert one.parts["ddp"] == one.parts["buffers"] == 0.0  # one process: no reducer, no broadcast
    with pytest.raises(ConfigError, match=r"ddp_step_s=-1.*>= 0 seconds"):
        replace(plat, ddp_step_s=-1.0)
