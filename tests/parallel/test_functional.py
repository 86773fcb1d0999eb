"""torch.nn.parallel's functional primitives, on CPU replicas: same signatures, same results."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.parallel as tp
from torch import nn

import multigpu
from multigpu.errors import ConfigError
from multigpu.parallel import gather, parallel_apply, replicate, scatter
from tests.models import assert_same_grads, mlp, twin


@pytest.mark.parametrize("name", ["scatter", "gather", "replicate", "parallel_apply", "data_parallel"])
def test_signatures_are_torchs(name: str) -> None:
    ours = inspect.signature(getattr(multigpu.parallel, name)).parameters
    theirs = inspect.signature(getattr(tp, name)).parameters
    positional = [p for p in ours.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in positional] == list(theirs)
    assert [p.default for p in positional] == [p.default for p in theirs.values()]


@pytest.mark.parametrize("batch", [1, 3, 5, 8, 13])
@pytest.mark.parametrize("devices", [2, 3, 4])
def test_scatter_splits_as_torch_chunk(batch: int, devices: int) -> None:
    x = torch.arange(batch * 2.0).reshape(batch, 2)
    pieces = scatter((x, "tag", {"y": x[:, 0]}), ["cpu"] * devices)
    want = x.chunk(devices)
    assert len(pieces) == len(want)
    for (px, tag, extra), wx in zip(pieces, want):
        torch.testing.assert_close(px, wx)
        torch.testing.assert_close(extra["y"], wx[:, 0])
        assert tag == "tag"
    assert [t.shape for t in scatter(x.t(), "cpu:2", dim=-1)] == [c.shape for c in x.t().chunk(2, -1)]


def test_gather_concatenates_and_stacks_scalars_like_torch() -> None:
    got = gather([(torch.ones(2, 3), torch.tensor(1.0)), (torch.zeros(1, 3), torch.tensor(2.0))], -1)
    assert got[0].shape == (3, 3) and got[0].device == torch.device("cpu")
    torch.testing.assert_close(got[1], torch.tensor([1.0, 2.0]))  # torch's Gather: a vector of the scalars
    torch.testing.assert_close(gather([torch.tensor(3.0)], "cpu"), torch.tensor([3.0]))


def test_replicate_gives_differentiable_or_detached_copies() -> None:
    net, ref = twin(mlp)
    x = torch.randn(6, 8)
    copies = replicate(net, ["cpu", "cpu", "cpu"])
    sum(c(part).sum() for c, part in zip(copies, x.chunk(3))).backward()  # type: ignore[union-attr]
    ref(x).sum().backward()
    assert_same_grads(net, ref)
    frozen = replicate(net, "cpu:2", detach=True)
    assert not frozen[1](x).requires_grad
    torch.testing.assert_close(frozen[1](x), net(x))


def test_parallel_apply_runs_each_module_with_its_inputs_and_kwargs() -> None:
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor, *, by: float = 1.0) -> torch.Tensor:
            return x * by + torch.is_grad_enabled()

    modules = [Scale(), Scale()]
    with torch.no_grad():  # grad mode reaches every thread
        out = parallel_apply(modules, [torch.ones(2), (torch.ones(3),)], [{"by": 2.0}, {"by": 3.0}])
    torch.testing.assert_close(out[0], torch.full((2,), 2.0))
    torch.testing.assert_close(out[1], torch.full((3,), 3.0))
    with pytest.raises(ConfigError, match=r"parallel_apply got 2 modules, 1 inputs; give one of each per module"):
        parallel_apply(modules, [torch.ones(2)])
    with pytest.raises(ZeroDivisionError, match=r"Caught ZeroDivisionError in replica 1 on device cpu:1"):
        parallel_apply([Scale(), _Fails()], [torch.ones(1), torch.ones(1)])


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / 0 if 1 / 0 else x


def test_data_parallel_is_one_devices_forward_and_backward() -> None:
    net, ref = twin(mlp)
    x = torch.randn(7, 8)
    out = multigpu.data_parallel(net, x, devices="cpu:3", output_device=-1)
    want = ref(x)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    assert_same_grads(net, ref)
    kw = multigpu.data_parallel(net, (x,), devices=["cpu", "cpu"], module_kwargs={})
    torch.testing.assert_close(kw, want)
