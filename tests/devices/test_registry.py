"""The device-type registry: adding a device type is one DeviceType subclass, registered.

The fake type here is torch's ``meta`` device (shapes, no data), so it runs on any machine. It is
a real registered type, not a stand-in for the registry: every check below goes through the
library's own entry points (parsing, accelerator lookup, synchronizing, RNG capture, the backend
choice, the engine's replica threads and imbalance warning, the profiler's clock).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multigpu
from multigpu.devices import (
    accelerator_type,
    capture_device_rng,
    device_count,
    device_type_names,
    get_device_type,
    parse_devices,
    register_device_type,
    restore_device_rng,
    synchronizer,
    unregister_device_type,
)
from multigpu.errors import ConfigError, DeviceError
from multigpu.parallel.threads import ReplicaThreads, run_replicas
from multigpu.profiling import clock
from multigpu.runtime.world import choose_backend
from tests.devices.fake_device import MetaDevice


def test_an_unregistered_type_is_refused_by_name() -> None:
    assert "meta" not in device_type_names()
    with pytest.raises(DeviceError, match=r"'meta' is not one of cpu, cuda, xpu, mps"):
        parse_devices("meta:0,1")
    with pytest.raises(
        DeviceError, match=r"device type 'meta' is not one of cpu, cuda, xpu, mps.*register_device_type"
    ):
        get_device_type("meta")


def test_a_registered_type_is_parsed_counted_and_found_as_the_accelerator(meta: MetaDevice) -> None:
    assert [d.label for d in parse_devices("meta:0,1")] == ["meta:0", "meta:1"]
    assert [d.label for d in parse_devices(None)] == ["meta:0", "meta:1"]  # every device of the accelerator
    assert [d.label for d in parse_devices([1])] == ["meta:1"]  # an index names the accelerator's device
    assert accelerator_type() == "meta" and device_count("meta") == 2
    assert get_device_type(torch.device("meta", 1)) is meta
    with pytest.raises(DeviceError, match=r"meta:2 \(from devices='meta:2'\) does not exist: this process sees 2"):
        parse_devices("meta:2")


def test_the_library_asks_the_registered_type(meta: MetaDevice) -> None:
    devices = [torch.device("meta", 0), torch.device("meta", 1), torch.device("meta", 1)]
    synchronizer(devices)()
    assert meta.synced == devices[:2]  # each distinct device once
    assert choose_backend("meta") == "fakebackend"
    states = capture_device_rng()
    assert [int(t) for t in states["meta"]] == [1, 2]
    meta.rng = [torch.tensor([9], dtype=torch.uint8)] * 2
    assert restore_device_rng(states) == ["meta"] and [int(t) for t in meta.rng] == [1, 2]
    assert clock.device_of("meta:1") == torch.device("meta", 1)
    assert isinstance(clock.mark(torch.device("meta", 1)), float) and meta.synced[-1] == torch.device("meta", 1)


def test_the_engine_enters_each_replicas_device_on_its_thread(meta: MetaDevice) -> None:
    replicas = parse_devices("meta:0,1")
    threads = ReplicaThreads()
    try:
        seen = run_replicas(lambda i: meta.current_device(), replicas, threads)
    finally:
        threads.close()
    assert seen == [torch.device("meta", 0), torch.device("meta", 1)]


def test_replica_threads_queue_work_on_the_callers_stream_of_each_device(meta: MetaDevice) -> None:
    """As torch's parallel_apply: the engine copies a replica's chunk on the caller's current stream
    of that device, so the replica's thread must compute on that stream too, or it may read the chunk
    before the copy lands."""
    replicas = parse_devices("meta:0,1")
    threads = ReplicaThreads()
    try:
        with meta.stream_context(("side", 1)):
            seen = run_replicas(lambda i: meta.current_stream(torch.device("meta", i)), replicas, threads)
        after = run_replicas(lambda i: meta.current_stream(torch.device("meta", i)), replicas, threads)
    finally:
        threads.close()
    assert seen == [("default", 0), ("side", 1)]
    assert after == [("default", 0), ("default", 1)]  # a worker thread keeps nothing from the last step


@pytest.mark.parametrize("spec", [[1, 1], ["meta:1", "meta:1"], [torch.device("meta", 0), 0], "meta:0,0"])
def test_an_accelerator_named_twice_is_refused_in_every_form(meta: MetaDevice, spec: object) -> None:
    """Two replicas on one accelerator are refused (the string form always was; lists slipped through)."""
    with pytest.raises(DeviceError, match=r"names meta:\d twice; list each meta device once"):
        parse_devices(spec)  # type: ignore[arg-type]
    assert [d.label for d in parse_devices(["cpu", "cpu"])] == ["cpu:0", "cpu:1"]  # CPU replicas may share it


def test_dataparallel_warns_of_imbalance_from_the_types_capacity(meta: MetaDevice) -> None:
    with pytest.warns(UserWarning, match=r"meta:0 has 50% of the memory of meta:1.*chunk_sizes='auto'"):
        multigpu.DataParallel(nn.Linear(2, 2).to("meta"), devices="meta:0,1")


def test_registering_a_name_twice_or_dropping_the_cpu_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"device type 'cuda' is registered already \(CudaDevice\)"):
        register_device_type(type(get_device_type("cuda"))())
    with pytest.raises(ConfigError, match="the cpu device type cannot be unregistered"):
        unregister_device_type("cpu")


def test_builtin_types_answer_on_this_machine() -> None:
    cpu = get_device_type("cpu")
    assert cpu.is_available() and cpu.device_count() == 1 and cpu.backend == "gloo"
    assert cpu.get_rng_state_all() is None and cpu.capacity(torch.device("cpu")) is None
    assert get_device_type("cuda").backend == "nccl" and get_device_type("cuda").timed_with_events
    for name in ("cuda", "xpu", "mps"):  # present or not, each answers without raising
        kind = get_device_type(name)
        assert kind.device_count() == (kind.device_count() if kind.is_available() else 0)


def test_timing_waits_for_every_device_type_not_only_cuda(meta: MetaDevice) -> None:
    """The planner's measurement and the auto-balancer's probe timer synchronize whatever type they time."""
    from multigpu.parallel.balance import _ReplicaTimer
    from multigpu.planning.counting import measure_workload

    measure_workload(nn.Linear(8, 4).to("meta"), torch.randn(4, 8, device="meta"), repeats=1)
    assert meta.synced and {d.type for d in meta.synced if d is not None} == {"meta"}
    meta.synced.clear()
    timer = _ReplicaTimer(parse_devices("meta:0,1"))
    timer.end(timer.begin("forward", "meta:1"), 0)
    assert meta.synced == [torch.device("meta", 1)] and timer.seconds["meta:1"] >= 0


def test_worker_processes_compute_on_the_cpu_unless_a_type_has_a_backend_of_its_own(meta: MetaDevice) -> None:
    """A type whose processes would use the CPU's gloo (as XPU and MPS do) leaves the workers on the CPU."""
    from multigpu.devices import process_device_type

    assert process_device_type() is meta  # available, with a backend of its own
    unregister_device_type("meta")
    register_device_type(_GlooMeta())  # the fixture unregisters it
    assert process_device_type() is get_device_type("cpu")


class _GlooMeta(MetaDevice):
    backend = "gloo"


def test_every_place_asks_which_type_a_worker_process_computes_on(
    meta: MetaDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule (devices.process_device_type), asked by the runtime, the launcher, the Session's auto and the CLI."""
    from multigpu.cli._advise_measure import present_accelerator
    from multigpu.cli.demo import default_devices
    from multigpu.devices import process_device_type
    from multigpu.launcher.allreduce_probe import default_backend
    from multigpu.launcher.launch import LaunchConfig, worker_env
    from multigpu.launcher.measure import _dp_devices
    from multigpu.launcher.torchrun import resolve_nproc
    from multigpu.runtime import world
    from multigpu.strategies.registry import resolve_strategy_name

    for key in ("RANK", "WORLD_SIZE", "MULTIGPU_STRATEGY"):  # not launched: auto decides on the devices
        monkeypatch.delenv(key, raising=False)
    assert process_device_type() is meta
    env = world.read_launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert env is not None and world.process_device(env) == torch.device("meta", 1)
    assert resolve_nproc(LaunchConfig(nproc_per_node="auto")) == 2  # one process per meta device
    with pytest.raises(DeviceError, match="3 processes per node were launched but this node sees 2 meta"):
        resolve_nproc(LaunchConfig(nproc_per_node=3))
    assert "MULTIGPU_BIND_CORES" not in worker_env(LaunchConfig(strategy="ddp"), "ddp", 2)  # binding: CPU workers only
    assert default_backend() == "gloo"  # torch lacks "fakebackend": the probe measures the CPU's instead
    known = torch.distributed.is_backend_available
    monkeypatch.setattr(torch.distributed, "is_backend_available", lambda name: name == "fakebackend" or known(name))
    assert default_backend() == "fakebackend"
    assert resolve_strategy_name("auto") == "dp"  # several devices of the workers' type, one process
    assert default_devices() == "meta" and _dp_devices(2) == "meta:0,1" and present_accelerator() == "meta"
