"""Where tensors live: a CPU batch into a CUDA model, and one replica per GPU.

The oracle is the bare module on the GPU, called on the same batch moved there by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multigpu
from multigpu.errors import DeviceError
from multigpu.parallel import data_parallel, replicate
from tests.cuda.conftest import tolerance
from tests.models import assert_same_grads, mlp, twin

pytestmark = pytest.mark.cuda
SPLIT_TOL = {"rtol": 1e-5, "atol": 1e-6}  # float32, the batch split across GPUs: sums in another order


class TwoInputs(nn.Module):
    """Takes a dict of a batch and a shared 0-dim scale, and a batch by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, batch: dict[str, torch.Tensor], *, offset: torch.Tensor) -> torch.Tensor:
        return self.net(batch["x"] + offset) * batch["scale"]


def test_a_cpu_batch_gives_the_bare_modules_outputs_and_gradients(gpu_ids: list[int]) -> None:
    net, ref = twin(mlp)
    model = multigpu.DataParallel(net.cuda(), device_ids=gpu_ids)
    ref.cuda()
    x = torch.randn(24, 8, requires_grad=True)  # on the CPU, as nn.DataParallel accepts it
    x_ref = x.detach().clone().requires_grad_()
    out, want = model(x), ref(x_ref.cuda())
    assert out.device == torch.device("cuda", 0)
    torch.testing.assert_close(out, want, **tolerance(gpu_ids, **SPLIT_TOL))
    out.square().sum().backward()
    want.square().sum().backward()
    assert_same_grads(net, ref, **tolerance(gpu_ids, **SPLIT_TOL))
    assert x.grad is not None and x.grad.device == torch.device("cpu")  # the gradient comes back to the CPU
    torch.testing.assert_close(x.grad, x_ref.grad, **tolerance(gpu_ids, **SPLIT_TOL))


def test_nested_cpu_inputs_and_the_loss_on_the_replicas(gpu_ids: list[int]) -> None:
    """A dict batch, a keyword tensor and CPU targets: every tensor reaches the replicas' GPUs."""
    net, ref = twin(TwoInputs)
    model = multigpu.DataParallel(net.cuda(), device_ids=gpu_ids, loss_fn=nn.CrossEntropyLoss())
    ref.cuda()
    x, y, offset = torch.randn(30, 8), torch.randint(0, 3, (30,)), torch.randn(30, 8)
    scale = torch.tensor(1.5)  # 0-dim: shared by every replica
    loss = model({"x": x, "scale": scale}, offset=offset, target=y)
    want = nn.functional.cross_entropy(ref({"x": x.cuda(), "scale": scale.cuda()}, offset=offset.cuda()), y.cuda())
    assert loss.device == torch.device("cuda", 0)
    torch.testing.assert_close(loss, want, **tolerance(gpu_ids, **SPLIT_TOL))
    loss.backward()
    want.backward()
    assert_same_grads(net, ref, **tolerance(gpu_ids, **SPLIT_TOL))
    assert [out.device.index for out in model.replica_outputs] == gpu_ids  # outputs stayed on their replicas


@pytest.mark.parametrize("spec", [[0, 0], "cuda:0,0", ["cuda:0", "cuda:0"], [torch.device("cuda", 0), 0]])
def test_two_replicas_on_one_gpu_are_refused_with_the_fix(spec: object) -> None:
    """One replica per accelerator (README, DataParallel's ``devices``): a second replica on the same
    GPU would share its queue and memory for no speed-up. Every form says so before anything is built."""
    net = mlp().cuda()
    message = r"names cuda:0 twice; list each cuda device once"
    with pytest.raises(DeviceError, match=message):
        multigpu.DataParallel(net, device_ids=spec)  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match=message):
        multigpu.DataParallel(net, devices=spec)  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match=message):
        replicate(net, spec)  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match=message):
        data_parallel(net, torch.randn(4, 8, device="cuda"), devices=spec)  # type: ignore[arg-type]
    assert multigpu.DataParallel(net, device_ids=[0])(torch.randn(4, 8)).shape == (4, 3)  # one is fine
