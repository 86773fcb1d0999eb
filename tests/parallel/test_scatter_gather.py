from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import multigpu
from multigpu.core.structure import flatten
from multigpu.devices import parse_devices
from multigpu.errors import ConfigError, GatherError, ScatterError
from multigpu.parallel.chunks import build_policy, proportional_sizes
from multigpu.parallel.scatter_gather import even_chunk_sizes, merge_outputs, split_inputs
from tests.models import assert_same_grads, twin

Out = namedtuple("Out", ["x", "n"])


@dataclass
class Result:
    x: torch.Tensor
    note: str


def split(inputs: object, sizes: list[int], devices: list, dim: int) -> list:
    """The engine's split of ``inputs``, one structure per active replica."""
    flat = flatten(inputs)
    return [flat.rebuild(row) for row in split_inputs(flat, sizes, devices, dim)]


def merge(outputs: list, sizes: list[int], target: torch.device, dim: int) -> object:
    """The engine's gather of per-replica ``outputs``."""
    return merge_outputs([flatten(out) for out in outputs], sizes, target, dim)


def test_even_sizes_give_the_remainder_to_the_first_devices() -> None:
    assert even_chunk_sizes(65, 2) == [33, 32]
    assert even_chunk_sizes(3, 4) == [1, 1, 1, 0]


def test_proportional_sizes_round_by_largest_remainder() -> None:
    assert proportional_sizes(10, [1, 1, 1]) == [4, 3, 3]
    assert proportional_sizes(64, [0.375, 0.625]) == [24, 40]
    assert proportional_sizes(5, [0.0, 1.0]) == [0, 5]


def test_fixed_sizes_must_sum_to_the_batch() -> None:
    policy = build_policy([24, 40], 2)
    assert policy.sizes(64) == [24, 40]
    with pytest.raises(ConfigError, match=r"chunk_sizes=\[24, 40\] sums to 64 but the batch has 10.*weights"):
        policy.sizes(10)
    assert build_policy([0.25, 0.75], 2).sizes(10) == [3, 7]


def test_scatter_shares_scalars_and_non_tensors_and_skips_empty_chunks() -> None:
    devices = parse_devices("cpu:3")
    x, s = torch.arange(4.0).reshape(2, 2), torch.tensor(3.0)
    parts = split(({"x": x, "s": s, "name": "n"},), [1, 1, 0], devices, 0)
    assert len(parts) == 2
    torch.testing.assert_close(parts[1][0]["x"], x[1:])
    assert parts[1][0]["s"] is not None and float(parts[1][0]["s"]) == 3.0
    assert parts[0][0]["name"] == "n"


def test_gather_keeps_namedtuples_dataclasses_and_weights_scalar_means() -> None:
    outs = [Out(torch.ones(1, 2), torch.tensor(1.0)), Out(torch.zeros(3, 2), torch.tensor(5.0))]
    got = merge(outs, [1, 3], torch.device("cpu"), 0)
    assert type(got) is Out
    assert got.x.shape == (4, 2)
    torch.testing.assert_close(got.n, torch.tensor(4.0, dtype=torch.float32))
    res = merge([Result(torch.ones(1), "a"), Result(torch.ones(2), "a")], [1, 2], torch.device("cpu"), 0)
    assert type(res) is Result and res.note == "a" and res.x.shape == (3,)
    differ = merge([Result(torch.ones(1), "a"), Result(torch.ones(1), "b")], [1, 1], torch.device("cpu"), 0)
    assert differ.note == ["a", "b"]


def test_gather_names_mismatched_structures() -> None:
    with pytest.raises(GatherError, match=r"replica outputs differ at \['k'\]: keys"):
        merge([{"k": {"a": torch.ones(1)}}, {"k": {"b": torch.ones(1)}}], [1, 1], torch.device("cpu"), 0)
    with pytest.raises(GatherError, match=r"output\[0\] has shape \(2,\), too few dims to gather on dim 1"):
        merge([(torch.ones(2),), (torch.ones(2),)], [1, 1], torch.device("cpu"), 1)


@pytest.mark.parametrize(
    "spec",
    [[float("nan"), 1.0], [float("inf"), 1.0], [1e308, 1e308], [10**400, 1], [1.0, -float("inf")]],
    ids=["nan", "inf", "sum-overflows", "huge-int", "minus-inf"],
)
def test_chunk_sizes_that_are_not_finite_numbers_are_refused(spec: list[float]) -> None:
    with pytest.raises(ConfigError, match=r"must hold finite numbers \(no NaN or infinity"):
        build_policy(spec, 2)


@pytest.mark.parametrize("spec", [[True, False], ["1", 1], [b"1", 1]])
def test_chunk_sizes_that_are_not_numbers_are_refused(spec: list[object]) -> None:
    with pytest.raises(ConfigError, match=r"must hold numbers: sizes like \[24, 40\]"):
        build_policy(spec, 2)  # type: ignore[arg-type]


class ShapeByReplica(nn.Module):
    """Returns a differently shaped tensor on the replica that gets a chunk of 1."""

    def __init__(self, odd: str) -> None:
        super().__init__()
        self.odd = odd

    def forward(self, x: torch.Tensor) -> dict:
        if x.size(0) == 1:
            return {"y": x.new_zeros(1, 5) if self.odd == "width" else x.new_zeros(1, 3, 1)}
        return {"y": x}


@pytest.mark.parametrize(
    ("odd", "message"),
    [
        (
            "width",
            r"output\['y'\] differs in shape across replicas in more than the batch dim 0 \(replica 0: \(2, 3\), replica 1: \(1, 5\)\)",
        ),
        (
            "rank",
            r"output\['y'\] has a different number of dims on different replicas \(replica 0: \(2, 3\), replica 1: \(1, 3, 1\)\)",
        ),
    ],
)
def test_replica_outputs_of_different_shapes_are_a_gather_error(odd: str, message: str) -> None:
    model = multigpu.DataParallel(ShapeByReplica(odd), devices="cpu:2", chunk_sizes=[2, 1])
    with pytest.raises(GatherError, match=message):
        model(torch.randn(3, 3))


class SparseMatmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(x, self.lin.weight.t()) + self.lin.bias


def test_a_sparse_coo_input_is_split_like_a_dense_one() -> None:
    net, ref = twin(SparseMatmul)
    dense = torch.randn(7, 6) * (torch.rand(7, 6) > 0.6)
    x = dense.to_sparse()
    out = multigpu.DataParallel(net, devices="cpu:3")(x)
    want = ref(x)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    assert_same_grads(net, ref)


def test_other_sparse_layouts_are_refused_with_the_conversion() -> None:
    x = torch.randn(4, 6).to_sparse_csr()
    with pytest.raises(ScatterError, match=r"input\[0\]\[0\] is a torch.sparse_csr tensor.*x.to_sparse_coo\(\)"):
        multigpu.DataParallel(SparseMatmul(), devices="cpu:2")(x)


class CountedWalks(dict):
    """A dict subclass (as a tokenizer's BatchEncoding) that counts how often a walk reads its values."""

    walks = 0

    def values(self):  # type: ignore[override]
        CountedWalks.walks += 1
        return super().values()


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, batch: dict) -> CountedWalks:
        return CountedWalks(y=self.lin(batch["x"]), s=self.lin(batch["x"]).sum())


@pytest.mark.parametrize("parallel_backward", [True, False])
def test_a_step_walks_its_inputs_once_and_each_replica_output_once(parallel_backward: bool) -> None:
    model = multigpu.DataParallel(DictModel(), devices="cpu:3", parallel_backward=parallel_backward)
    batch = CountedWalks(x=torch.randn(6, 4))
    CountedWalks.walks = 0
    out = model(batch)
    assert CountedWalks.walks == 1 + 3  # the inputs once, each replica's output once (torch: the same)
    assert type(out) is CountedWalks and out["y"].shape == (6, 2)
    out["y"].sum().backward()
