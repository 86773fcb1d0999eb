"""DataParallel against the one-device oracle: same loss, outputs and gradients."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import multigpu
from tests.models import TinyLM, assert_same_grads, mlp, twin

Pair = namedtuple("Pair", ["a", "b"])


class Nested(nn.Module):
    """Takes nested inputs (tuple, dict, namedtuple, shared scalar, non-tensor) and returns nested outputs."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.lin = nn.Linear(4, 4)

    def forward(self, pair: Pair, extra: dict, scale: torch.Tensor, tag: str = "x") -> dict:
        moved = [t.movedim(self.dim, 0) for t in (pair.a, pair.b, extra["c"])]
        y = self.lin(moved[0]) * scale + moved[1] - moved[2].sum(-1, keepdim=True)
        return {"y": y.movedim(0, self.dim), "parts": (moved[0].movedim(0, self.dim), None), "tag": tag}


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 13),
    replicas=st.integers(2, 4),
    dim=st.integers(0, 1),
    weights=st.none() | st.lists(st.floats(0.1, 3.0), min_size=4, max_size=4),
)
def test_nested_inputs_outputs_and_grads_match_one_device(
    batch: int, replicas: int, dim: int, weights: list[float] | None
) -> None:
    torch.manual_seed(batch)
    net, ref = twin(Nested, dim)
    shape = (batch, 3, 4) if dim == 0 else (3, batch, 4)
    a, b = torch.randn(shape), torch.randn(shape)
    c = torch.randn((*shape[:2], 2))
    scale = torch.tensor(1.5)
    a2 = a.clone().requires_grad_()
    a.requires_grad_()
    chunk_sizes = None if weights is None else weights[:replicas]
    model = multigpu.DataParallel(net, devices=f"cpu:{replicas}", dim=dim, chunk_sizes=chunk_sizes)
    out = model(Pair(a, b), {"c": c}, scale, tag="t")
    want = ref(Pair(a2, b), {"c": c}, scale, tag="t")
    torch.testing.assert_close(out["y"], want["y"])
    torch.testing.assert_close(out["parts"][0], want["parts"][0])
    assert out["parts"][1] is None and out["tag"] == "t"
    (out["y"] ** 2).mean().backward()
    (want["y"] ** 2).mean().backward()
    assert_same_grads(net, ref)
    torch.testing.assert_close(a.grad, a2.grad)


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 9), replicas=st.integers(2, 3), steps=st.integers(1, 3))
def test_training_steps_end_with_the_same_weights(batch: int, replicas: int, steps: int) -> None:
    net, ref = twin(mlp)
    model = multigpu.DataParallel(net, devices=f"cpu:{replicas}")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (net, ref)]
    for _step in range(steps):
        x, y = torch.randn(batch, 8), torch.randint(0, 3, (batch,))
        losses = []
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1])
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_transformer_with_dataclass_output_and_its_own_loss() -> None:
    net, ref = twin(TinyLM)
    model = multigpu.DataParallel(net, devices="cpu:2")
    ids = torch.randint(0, 50, (7, 16))
    out = model(input_ids=ids, labels=ids)
    want = ref(input_ids=ids, labels=ids)
    assert type(out) is type(want)
    assert list(out.keys()) == ["loss", "logits", "hidden"]
    assert out.loss.dim() == 0
    # chunks of 4 and 3: the chunk-weighted mean of the replica losses is the whole-batch mean
    torch.testing.assert_close(out.loss, want.loss)
    torch.testing.assert_close(out.logits, want.logits, atol=1e-5, rtol=1e-4)
    out.loss.backward()
    want.loss.backward()
    assert_same_grads(net, ref, atol=1e-5, rtol=1e-4)


def test_scalar_output_rules() -> None:
    class SumLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.w).sum()

    x = torch.randn(5, 3)
    want = SumLoss()(x)
    summed = multigpu.DataParallel(SumLoss(), devices="cpu:2", scalar_outputs="sum")(x)
    stacked = multigpu.DataParallel(SumLoss(), devices="cpu:2", scalar_outputs="stack")(x)
    torch.testing.assert_close(summed, want)
    assert stacked.shape == (2,)
    torch.testing.assert_close(stacked.sum(), want)


def test_higher_order_gradients_on_the_engine_path() -> None:
    net, ref = twin(mlp)
    model = multigpu.DataParallel(net, devices="cpu:2", parallel_backward=False)
    x = torch.randn(6, 8)
    grads = []
    for m, params in ((model, list(net.parameters())), (ref, list(ref.parameters()))):
        loss = m(x).pow(2).sum()
        (g,) = torch.autograd.grad(loss, params[0], create_graph=True)
        g.pow(2).sum().backward()
        grads.append(params[0].grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_unsupported_backward_modes_name_the_fix() -> None:
    model = multigpu.DataParallel(mlp(), devices="cpu:2")
    loss = model(torch.randn(4, 8)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"a second time \(retain_graph=True\).*parallel_backward=False"):
        loss.backward()
    loss = model(torch.randn(4, 8)).sum()
    with pytest.raises(RuntimeError, match=r"create_graph=True.*parallel_backward=False"):
        torch.autograd.grad(loss, next(iter(model.parameters())), create_graph=True)
