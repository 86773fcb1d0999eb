from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from multigpu.devices import parse_devices
from multigpu.errors import ConfigError, GatherError
from multigpu.parallel.chunks import build_policy, proportional_sizes
from multigpu.parallel.scatter_gather import even_chunk_sizes, gather, scatter

Out = namedtuple("Out", ["x", "n"])


@dataclass
class Result:
    x: torch.Tensor
    note: str


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
    parts = scatter(({"x": x, "s": s, "name": "n"},), [1, 1, 0], devices, 0)
    assert len(parts) == 2
    torch.testing.assert_close(parts[1][0]["x"], x[1:])
    assert parts[1][0]["s"] is not None and float(parts[1][0]["s"]) == 3.0
    assert parts[0][0]["name"] == "n"


def test_gather_keeps_namedtuples_dataclasses_and_weights_scalar_means() -> None:
    outs = [Out(torch.ones(1, 2), torch.tensor(1.0)), Out(torch.zeros(3, 2), torch.tensor(5.0))]
    got = gather(outs, [1, 3], torch.device("cpu"), 0)
    assert type(got) is Out
    assert got.x.shape == (4, 2)
    torch.testing.assert_close(got.n, torch.tensor(4.0, dtype=torch.float32))
    res = gather([Result(torch.ones(1), "a"), Result(torch.ones(2), "a")], [1, 2], torch.device("cpu"), 0)
    assert type(res) is Result and res.note == "a" and res.x.shape == (3,)
    differ = gather([Result(torch.ones(1), "a"), Result(torch.ones(1), "b")], [1, 1], torch.device("cpu"), 0)
    assert differ.note == ["a", "b"]


def test_gather_names_mismatched_structures() -> None:
    with pytest.raises(GatherError, match=r"replica outputs differ at \['k'\]: keys"):
        gather([{"k": {"a": torch.ones(1)}}, {"k": {"b": torch.ones(1)}}], [1, 1], torch.device("cpu"), 0)
    with pytest.raises(GatherError, match=r"output\[0\] has shape \(2,\), too few dims to gather on dim 1"):
        gather([(torch.ones(2),), (torch.ones(2),)], [1, 1], torch.device("cpu"), 1)
