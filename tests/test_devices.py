import pytest
import torch

from multigpu.devices import parse_devices
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
