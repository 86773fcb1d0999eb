"""One test per row of the README table "Differences from nn.DataParallel" (multigpu's side of
each row; torch's side is read from torch/nn/parallel, cited in the row)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import multigpu
from multigpu.errors import ConfigError, ScatterError
from tests.models import mlp, twin


def test_row_devices_cpu_replicas_run_in_threads() -> None:
    seen: set[int] = set()

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.add(threading.get_ident())
            return x

    multigpu.DataParallel(Spy(), devices="cpu:2")(torch.randn(4, 2))
    assert len(seen) == 2  # nn.DataParallel without CUDA calls the module once, on the caller


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("parallel_backward", [True, False])
def test_row_unused_parameters_keep_no_gradient_as_on_one_device(parallel_backward: bool) -> None:
    net, ref = twin(WithUnused)
    multigpu.DataParallel(net, devices="cpu:2", parallel_backward=parallel_backward)(torch.randn(4, 4)).sum().backward()
    ref(torch.randn(4, 4)).sum().backward()
    assert ref.unused.weight.grad is None
    assert net.unused.weight.grad is None and net.used.weight.grad is not None


def test_row_replica_parameters_are_leaves() -> None:
    kinds: list[tuple[bool, bool]] = []

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            kinds.append((self.lin.weight.is_leaf, self.lin.weight.grad_fn is None))
            return self.lin(x)

    multigpu.DataParallel(Spy(), devices="cpu:2")(torch.randn(4, 2)).sum().backward()
    assert kinds == [(True, True), (True, True)]


def test_row_state_dict_keys_are_the_bare_models() -> None:
    net = mlp()
    assert list(multigpu.DataParallel(net, devices="cpu:2").state_dict()) == list(net.state_dict())
    assert all(k.startswith("module.") for k in nn.DataParallel(net).state_dict())


def test_row_scalar_outputs_are_the_chunk_weighted_mean() -> None:
    class MeanLoss(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean()

    x = torch.randn(5, 3)
    torch.testing.assert_close(multigpu.DataParallel(MeanLoss(), devices="cpu:2")(x), x.mean())
    stacked = multigpu.DataParallel(MeanLoss(), devices="cpu:2", scalar_outputs="stack")(x)
    torch.testing.assert_close(stacked, torch.stack([x[:3].mean(), x[3:].mean()]))  # nn.DataParallel's vector


def test_row_a_batch_is_split_evenly_over_every_device() -> None:
    sizes: list[int] = []
    lock = threading.Lock()

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with lock:
                sizes.append(x.size(0))
            return x

    multigpu.DataParallel(Spy(), devices="cpu:4")(torch.randn(5, 2))
    assert sorted(sizes, reverse=True) == [2, 1, 1, 1]
    assert [c.size(0) for c in torch.randn(5, 2).chunk(4)] == [2, 2, 1]  # nn.DataParallel's split (comm.scatter)


def test_row_an_empty_batch_is_an_error() -> None:
    assert [c.size(0) for c in torch.randn(0, 2).chunk(2)] == [0, 0]  # nn.DataParallel's split: empty chunks
    with pytest.raises(ScatterError, match=r"input\[0\]\[0\] has an empty batch .*skip empty batches"):
        multigpu.DataParallel(nn.Linear(2, 1), devices="cpu:2")(torch.randn(0, 2))


def test_row_inputs_whose_batch_sizes_disagree_are_an_error() -> None:
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a

    with pytest.raises(ScatterError, match=r"inputs disagree on the batch size"):
        multigpu.DataParallel(Two(), devices="cpu:2")(torch.randn(4, 2), torch.randn(6, 2))


@dataclass
class Out:
    logits: torch.Tensor
    note: str


def test_row_dataclass_outputs_keep_their_type() -> None:
    class Returns(nn.Module):
        def forward(self, x: torch.Tensor) -> Out:
            return Out(x * 2, "ok")

    out = multigpu.DataParallel(Returns(), devices="cpu:3")(torch.randn(5, 2))
    assert type(out) is Out and out.logits.shape == (5, 2) and out.note == "ok"


def test_row_autocast_dtype_reaches_the_replicas() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = multigpu.DataParallel(nn.Linear(4, 4), devices="cpu:2")(torch.randn(4, 4))
    assert out.dtype == torch.bfloat16


def test_row_wrapping_a_wrapper_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"module is already a DataParallel"):
        multigpu.DataParallel(nn.DataParallel(mlp()), devices="cpu:2")
