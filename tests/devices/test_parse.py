import pytest
import torch
from torch import nn

import multigpu
from multigpu.devices import MAX_REPLICAS, parse_devices, parse_output_device
from multigpu.errors import DeviceError


@pytest.mark.parametrize(
    ("spec", "labels"),
    [
        ("cpu:2", ["cpu:0", "cpu:1"]),
        ("cpu", ["cpu"]),
        ("CPU:3", ["cpu:0", "cpu:1", "cpu:2"]),
        (["cpu", "cpu"], ["cpu:0", "cpu:1"]),
        ([torch.device("cpu")], ["cpu"]),
        (None, ["cpu"]),
    ],
)
def test_parses_cpu_forms(spec: object, labels: list[str]) -> None:
    if spec is None and torch.cuda.is_available():
        pytest.skip("the default picks GPUs where there are some")
    devices = parse_devices(spec)  # type: ignore[arg-type]
    assert [d.label for d in devices] == labels
    assert all(d.device == torch.device("cpu") for d in devices)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpu:0,1", r"device string 'gpu:0,1' does not parse"),
        ("cpu:0", r"'cpu:N' takes a replica count N >= 1"),
        ("cuda:0,7", r"cuda:0 \(from devices='cuda:0,7'\) does not exist|cuda:7 .*does not exist"),
        ([], r"devices=\[\] names no device"),
        ([0, 1], r"device index 0 names an accelerator, but none is visible.*devices='cpu:2'"),
        ("cpu:1,2", r"'cpu:N' takes a replica count"),
        (3.5, r"devices=3.5 is not a device specification"),
    ],
)
def test_bad_specs_name_the_value_and_the_fix(spec: object, message: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("messages differ where GPUs are visible")
    with pytest.raises(DeviceError, match=message):
        parse_devices(spec)  # type: ignore[arg-type]


@pytest.mark.cuda
def test_cuda_indices() -> None:
    n = torch.cuda.device_count()
    assert [d.label for d in parse_devices(list(range(n)))] == [f"cuda:{i}" for i in range(n)]
    assert [d.label for d in parse_devices("cuda")] == [f"cuda:{i}" for i in range(n)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("spec", ["cpu:99999999", "cpu:65", ["cpu"] * 65])
def test_replica_count_is_capped_before_anything_is_built(spec: object) -> None:
    with pytest.raises(DeviceError, match=r"at most 64 \(multigpu.devices.MAX_REPLICAS\).*--strategy ddp"):
        parse_devices(spec)  # type: ignore[arg-type]
    assert len(parse_devices(f"cpu:{MAX_REPLICAS}")) == MAX_REPLICAS


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([None], r"holds None \(NoneType\); each entry must be an accelerator index"),
        ([object()], r"holds <object object at .*> \(object\)"),
        (["cpu", 1.5], r"holds 1.5 \(float\)"),
        ([True], r"holds True \(bool\)"),
        (b"cpu:2", r"devices=b'cpu:2' is not a device specification"),
        (bytearray(b"cpu"), r"is not a device specification"),
        (True, r"devices=True is not a device specification"),
        (["cpu", "nonsense:x"], r"device 'nonsense:x' does not parse"),
    ],
)
def test_entries_of_other_types_are_refused_by_name(spec: object, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        parse_devices(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "want"),
    [(None, "cpu"), (-1, "cpu"), ("cpu", "cpu"), ("cpu:1", "cpu"), (torch.device("cpu"), "cpu")],
)
def test_output_device_forms(spec: object, want: str) -> None:
    assert parse_output_device(spec, torch.device("cpu")) == torch.device(want)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (1.5, r"output_device=1.5 \(float\) is not a device; pass an accelerator index"),
        (object(), r"\(object\) is not a device"),
        (True, r"output_device=True \(bool\) is not a device"),
        ("cuda:0:1", r"device 'cuda:0:1' does not parse"),
        ("gpu", r"device 'gpu' does not parse"),
        ("meta", r"'meta' is not one of cpu, cuda, xpu, mps"),
        (-2, r"output_device=-2 names an accelerator index"),
    ],
)
def test_bad_output_devices_are_named(spec: object, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        parse_output_device(spec, torch.device("cpu"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (0, r"output_device=0 names an accelerator index, but none is visible.*output_device='cpu' \(or -1\)"),
        ("cuda:0", r"cuda:0 \(from output_device='cuda:0'\) does not exist: this process sees 0 cuda"),
        (torch.device("cuda", 3), r"cuda:3 \(from output_device=device\(type='cuda', index=3\)\) does not exist"),
    ],
)
def test_output_device_on_missing_hardware(spec: object, message: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("the accelerator is there")
    with pytest.raises(DeviceError, match=message):
        multigpu.DataParallel(nn.Linear(2, 2), devices="cpu:2", output_device=spec)  # type: ignore[arg-type]
