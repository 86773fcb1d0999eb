"""Regression tests for gradients that were silently wrong, each against the one-device oracle."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multigpu
from tests.models import assert_same_grads, twin
from tests.parallel.test_balance import BigHead


def _train_auto(set_to_none: bool, micro_batches: int) -> tuple[nn.Module, nn.Module]:
    """Four SGD-with-momentum steps, auto-balanced on cpu:2 and on one device, same batches."""
    net, ref = twin(BigHead)
    model = multigpu.DataParallel(net, devices="cpu:2", chunk_sizes="auto")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (net, ref)]
    for _ in range(4):
        xs = [torch.randn(16, 8) for _ in range(micro_batches)]
        ys = [torch.randint(0, 2048, (16,)) for _ in range(micro_batches)]
        for m, opt in zip((model, ref), opts):
            opt.zero_grad(set_to_none=set_to_none)
            for x, y in zip(xs, ys):
                (nn.functional.cross_entropy(m(x), y) / micro_batches).backward()
            opt.step()
    assert model.balance_plans, "the probe never ran: the test would check nothing"
    return net, ref


@pytest.mark.parametrize(("set_to_none", "micro_batches"), [(False, 1), (True, 2), (False, 3)])
def test_auto_balance_probe_leaves_the_users_gradients_alone(set_to_none: bool, micro_batches: int) -> None:
    # The probe used to restore .grad by reference after its own backward had added into that very
    # tensor: zero_grad(set_to_none=False) or accumulation then stepped on ~2x the gradient.
    net, ref = _train_auto(set_to_none, micro_batches)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert_same_grads(net, ref, rtol=1e-5, atol=1e-6)


class ScaledByBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3, requires_grad=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.parametrize("parallel_backward", [True, False])
@pytest.mark.parametrize("devices", ["cpu:2", "cpu:3"])
def test_a_buffer_that_requires_grad_gets_every_replicas_gradient(parallel_backward: bool, devices: str) -> None:
    # It used to get only replica 0's share (2 of 4 samples on cpu:2), as if the batch were smaller.
    net, ref = twin(ScaledByBuffer)
    model = multigpu.DataParallel(net, devices=devices, parallel_backward=parallel_backward)
    x = torch.randn(4, 3)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert net.scale.grad is not None
    torch.testing.assert_close(net.scale.grad, ref.scale.grad)
    assert_same_grads(net, ref)


def test_a_buffer_that_requires_grad_accumulates_through_the_auto_balance_probe() -> None:
    net, ref = twin(ScaledByBuffer)
    model = multigpu.DataParallel(net, devices="cpu:2", chunk_sizes="auto")
    x = torch.randn(6, 3)
    for _ in range(3):  # accumulated; the second call probes, and the probe must add nothing
        model(x).sum().backward()
        ref(x).sum().backward()
    assert 6 in model.balance_plans
    torch.testing.assert_close(net.scale.grad, ref.scale.grad)
    assert_same_grads(net, ref)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
