"""A device's peak FLOP/s (MFU's denominator): the datasheet's for the GPUs MFU is quoted on, else measured and cached."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from multigpu.devices import get_device_type
from multigpu.devices.peak_flops import datasheet_flops, measure_matmul_flops

CPU = torch.device("cpu")


def test_the_datasheet_names_the_gpu_by_the_fragment_of_its_name() -> None:
    assert datasheet_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert datasheet_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12  # not the SXM figure
    assert datasheet_flops("NVIDIA A100-SXM4-40GB", torch.float32) == 19.5e12
    assert datasheet_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # no bf16 on a V100
    assert datasheet_flops("cpu", torch.float32) is None


def test_the_cpu_is_measured_once_and_read_back_from_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "peak-flops.json"
    cpu = get_device_type("cpu")
    measured = cpu.peak_flops(CPU, torch.float32, cache)
    assert 1e8 < measured < 1e14  # a matmul on this CPU: between 0.1 GFLOP/s and 100 TFLOP/s
    (key,) = json.loads(cache.read_text())
    cache.write_text(json.dumps({key: 123.0}))  # what a run measured on this machine before
    assert cpu.peak_flops(CPU, torch.float32, cache) == 123.0


def test_a_garbled_cache_is_measured_over(tmp_path: Path) -> None:
    cache = tmp_path / "peak-flops.json"
    cache.write_text("[1e999")
    assert get_device_type("cpu").peak_flops(CPU, torch.float32, cache) > 1e8
    assert all(v > 1e8 for v in json.loads(cache.read_text()).values())


def test_the_measurement_times_a_matmul() -> None:
    # the same matmul timed with torch's own benchmark timer reaches the same order of FLOP/s
    from torch.utils.benchmark import Timer

    a = torch.randn(1024, 1024)
    seconds = Timer("torch.mm(a, a)", globals={"a": a, "torch": torch}).blocked_autorange(min_run_time=0.2).median
    ratio = measure_matmul_flops(get_device_type("cpu"), CPU, torch.float32) / (2 * 1024**3 / seconds)
    assert 0.3 < ratio < 10  # fastest of five against a median: above 1 on a loaded machine


def test_measurements_written_at_once_each_land_in_the_cache(tmp_path: Path) -> None:
    # each writer read the cache, measured (a tenth of a second and more) and renamed its copy with its own key
    # over the file: a measurement another process or thread wrote meanwhile was dropped (measured again later)
    import threading

    cache, dtypes = tmp_path / "peak-flops.json", [torch.float32, torch.float64, torch.bfloat16]
    start, errors = threading.Barrier(len(dtypes)), list[BaseException]()

    def measure(dtype: torch.dtype) -> None:
        start.wait()
        try:
            get_device_type("cpu").peak_flops(CPU, dtype, cache)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=measure, args=(d,)) for d in dtypes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(json.loads(cache.read_text())) == len(dtypes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peak-flops.json"]


def test_a_cache_holding_an_int_past_the_largest_float_is_measured_over(tmp_path: Path) -> None:
    cache = tmp_path / "peak-flops.json"  # float() of it raised OverflowError out of the throughput report
    get_device_type("cpu").peak_flops(CPU, torch.float32, cache)
    (key,) = json.loads(cache.read_text())
    cache.write_text(json.dumps({key: 10**400}))
    assert 1e8 < get_device_type("cpu").peak_flops(CPU, torch.float32, cache) < 1e14
