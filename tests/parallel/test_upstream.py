"""nn.DataParallel semantics that multigpu.DataParallel mirrors (torch/nn/parallel/data_parallel.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import multigpu
from tests.models import assert_same_grads, mlp, twin


def test_output_device_minus_one_is_the_cpu() -> None:
    model = multigpu.DataParallel(mlp(), devices="cpu:2", output_device=-1)
    assert model.output_device == torch.device("cpu")
    assert model(torch.randn(4, 8)).device == torch.device("cpu")


class LastDimBatch(nn.Module):
    """Takes its batch on the last dim: (features, batch) -> (classes, batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.lin(x.transpose(0, -1)).transpose(0, -1) + bias


@pytest.mark.parametrize("dim", [-1, 1])
def test_a_negative_dim_counts_from_the_last_like_nn_data_parallel(dim: int) -> None:
    net, ref = twin(LastDimBatch)
    x = torch.randn(8, 7, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    bias = torch.tensor(0.5)  # 0-dim: shared by every replica, whatever the dim
    out = multigpu.DataParallel(net, devices="cpu:3", dim=dim)(x, bias)
    want = ref(x2, bias)
    torch.testing.assert_close(out, want)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    assert_same_grads(net, ref)
    torch.testing.assert_close(x.grad, x2.grad)


def test_lazy_modules_get_nn_data_parallels_error_and_work_on_one_device() -> None:
    with pytest.raises(RuntimeError, match=r"Modules with uninitialized parameters can't be used with `DataParallel`"):
        multigpu.DataParallel(nn.LazyLinear(3), devices="cpu:2")(torch.randn(4, 5))
    lazy = nn.LazyLinear(3)
    assert multigpu.DataParallel(lazy, devices="cpu")(torch.randn(4, 5)).shape == (4, 3)  # initialised by the call
    assert multigpu.DataParallel(lazy, devices="cpu:2")(torch.randn(4, 5)).shape == (4, 3)


class MissingKey(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) < 2:
            raise KeyError("no entry for\nthis sample")
        return x


def test_a_replicas_key_error_stays_readable() -> None:
    with pytest.raises(KeyError) as caught:
        multigpu.DataParallel(MissingKey(), devices="cpu:2", chunk_sizes=[2, 1])(torch.randn(3, 2))
    message = str(caught.value)
    assert message.startswith("Caught KeyError in replica 1 on device cpu:1 during forward.\n")
    # one line per traceback line, as torch's ExceptionWrapper gives (KeyError's str() is its repr)
    assert "\nOriginal Traceback (most recent call last):\n" in message
    assert message.rstrip().endswith("KeyError: 'no entry for\\nthis sample'")


def test_the_imbalance_warning_names_the_device_and_chunk_sizes_auto() -> None:
    from multigpu.devices import DeviceCapacity
    from multigpu.parallel.balance import imbalance_warning

    big, small = DeviceCapacity(80 * 2**30, 132), DeviceCapacity(24 * 2**30, 132)
    message = imbalance_warning(["cuda:0", "cuda:1"], [big, small])
    assert message is not None
    assert message.startswith("cuda:1 has 30% of the memory of cuda:0") and "chunk_sizes='auto'" in message
    fewer_cores = imbalance_warning(["cuda:0", "cuda:1"], [big, DeviceCapacity(80 * 2**30, 66)])
    assert fewer_cores is not None and "50% of the cores" in fewer_cores
    assert imbalance_warning(["cuda:0", "cuda:1"], [big, DeviceCapacity(64 * 2**30, 110)]) is None  # >= 75%
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        multigpu.DataParallel(mlp(), devices="cpu:2")  # CPU replicas are identical: no warning


def test_one_device_calls_the_module_with_the_inputs_as_they_are() -> None:
    seen: list[object] = []

    class Spy(nn.Module):
        def forward(self, batch: dict) -> dict:
            seen.append(batch)
            return batch

    batch = {"x": torch.randn(3, 2)}
    assert multigpu.DataParallel(Spy(), devices="cpu")(batch) is batch  # nothing rebuilt, nothing copied
    assert seen == [batch]


@pytest.mark.cuda
def test_one_device_moves_a_cpu_batch_to_the_device() -> None:
    net = mlp().cuda()
    model = multigpu.DataParallel(net, device_ids=[0])
    out = model(torch.randn(4, 8))  # a CPU batch, as nn.DataParallel accepts it
    assert out.device == torch.device("cuda", 0)


@pytest.mark.cuda
@pytest.mark.parametrize("count", [1, 2])
def test_output_device_minus_one_on_cuda_lands_where_nn_data_parallels_does(count: int) -> None:
    """Gathered on the CPU from two GPUs; with one, nn.DataParallel calls the module as it is and ignores
    output_device, and so does multigpu (its one-device path is kept)."""
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs")
    ids = list(range(count))
    net = mlp().cuda()
    x = torch.randn(4 * count, 8, device="cuda")
    ours = multigpu.DataParallel(net, device_ids=ids, output_device=-1)(x).device
    assert ours == nn.DataParallel(net, device_ids=ids, output_device=-1)(x).device
    assert ours == (torch.device("cuda", 0) if count == 1 else torch.device("cpu"))
