"""The toolkit's exchanges on a real one-rank gloo group against plain torch: hypothesis draws the dtypes, shapes
and structures, so both ways a reduction travels (in the header, or header then all-reduce), the agreement
header of every gather, broadcast and pad, and the leaves that cannot travel are all met.

With one rank the answer is what one device has: a gather is the tensor's rows, a reduce the value itself
(in the documented dtype), a broadcast a copy, a pad nothing. The disagreements between ranks are in
``tests/session/test_disagreement.py`` (real 2- and 3-rank runs).
"""

from __future__ import annotations

import os
from collections import OrderedDict, defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multigpu.errors import ConfigError
from multigpu.runtime import collectives, exchange
from multigpu.session import Session

_EXAMPLES = int(os.environ.get("MULTIGPU_FUZZ_EXAMPLES", "30"))
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16]
DTYPES += [torch.int32, torch.int64, torch.bool]
OPS = ["mean", "sum", "max", "min"]
_GROUP = settings(
    max_examples=_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # one group serves every example
)


@st.composite
def tensors(draw: st.DrawFn, max_side: int = 4) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, max_side), max_size=3))
    if draw(st.booleans()) and shape:
        shape[0] = draw(st.integers(8, 40))  # past the header's payload: the all-reduce path
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    values = torch.randint(-50, 50, shape, generator=gen) if dtype != torch.bool else torch.randint(0, 2, shape)
    return values.to(dtype)


def structures(leaf: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaf,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
        max_leaves=5,
    )


def _pairs(a: Any, b: Any) -> Iterator[tuple[Any, Any]]:
    """The leaves of two structures of one shape, side by side."""
    if isinstance(a, Mapping):
        assert isinstance(b, Mapping) and list(a) == list(b)
        for key in a:
            yield from _pairs(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            yield from _pairs(x, y)
    else:
        yield a, b


def _reduced_dtype(tensor: torch.Tensor, op: str) -> torch.dtype:
    """The documented rule: dtype kept, a mean of integers in float32."""
    return tensor.dtype if tensor.is_floating_point() or op != "mean" else torch.float32


@_GROUP
@given(obj=structures(tensors()), op=st.sampled_from(OPS))
def test_reduce_on_one_rank_is_the_value_in_the_documented_dtype(one_rank_group: None, obj: Any, op: str) -> None:
    got = exchange.reduce(obj, op)
    for mine, back in _pairs(obj, got):
        assert back.dtype == _reduced_dtype(mine, op) and back.shape == mine.shape
        assert torch.equal(back, mine.to(back.dtype)), (mine, back)


@_GROUP
@given(
    value=st.one_of(
        st.floats(-1e6, 1e6),
        st.integers(-(2**40), 2**40),
        st.booleans(),
        st.sampled_from([np.float32(2.5), np.float64(-1.25), np.int64(7), np.int8(-3), np.bool_(True), np.uint16(9)]),
    ),
    op=st.sampled_from(OPS),
)
def test_numbers_python_s_and_numpy_s_come_back_as_floats(one_rank_group: None, value: Any, op: str) -> None:
    got = exchange.reduce({"v": value, "in": [value]}, op)
    assert type(got["v"]) is float and got["v"] == float(value) and got["in"] == [float(value)]


@_GROUP
@given(
    dtype=st.sampled_from([np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_]),
    shape=st.lists(st.integers(0, 12), max_size=3),
    op=st.sampled_from(OPS),
)
def test_numpy_arrays_reduce_as_tensors_and_stay_arrays(
    one_rank_group: None, dtype: Any, shape: list[int], op: str
) -> None:
    array = np.asarray(np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) % 3).astype(dtype)
    got = exchange.reduce(array, op)
    want = dtype if np.dtype(dtype).kind == "f" or op != "mean" else np.float32
    assert isinstance(got, np.ndarray) and got.dtype == want and got.shape == array.shape
    np.testing.assert_array_equal(got, array.astype(want))


@_GROUP
@given(obj=structures(tensors() | st.sampled_from(["note", None, 3])))
def test_gather_broadcast_and_pad_on_one_rank_against_plain_torch(one_rank_group: None, obj: Any) -> None:
    gathered = exchange.gather(obj)
    broadcast = exchange.broadcast(obj)
    padded = exchange.pad_across_processes(obj, dim=0)
    for g, b, p in zip(*(list(_pairs(obj, o)) for o in (gathered, broadcast, padded)), strict=True):
        mine = g[0]
        if not isinstance(mine, torch.Tensor):
            assert g[1] == b[1] == p[1] == mine  # other leaves stay as they are
            continue
        assert torch.equal(g[1], mine.reshape(1) if mine.dim() == 0 else mine) and g[1].dtype == mine.dtype
        assert torch.equal(b[1], mine) and b[1].dtype == mine.dtype and b[1] is not mine
        assert p[1] is mine  # already the largest


def test_a_reduction_takes_one_collective_when_small_and_two_when_not(one_rank_group: None) -> None:
    small = collectives.tracking._ledger.seq
    exchange.reduce({"loss": torch.tensor(1.5), "n": 3, "hist": torch.ones(4, dtype=torch.int32)}, "sum")
    large = collectives.tracking._ledger.seq
    exchange.reduce(torch.ones(collectives.PAYLOAD + 1))
    assert large - small == 1 and collectives.tracking._ledger.seq - large == 2
    before = collectives.tracking._ledger.seq
    exchange.gather({"a": torch.ones(2), "b": torch.ones(3, 2), "c": "kept"})
    assert collectives.tracking._ledger.seq - before == 3  # the sizes of both at once, then one gather each


@pytest.mark.parametrize("op", OPS)
def test_what_cannot_be_reduced_is_refused_by_name(one_rank_group: None, op: str) -> None:
    for leaf, words in [
        ("x", "a str"),
        (None, "None"),
        (np.array(["a"]), "a ndarray"),
        (1 + 2j, "a complex"),
        (np.complex64(1), "a complex64"),
    ]:
        with pytest.raises(ConfigError, match=rf"reduce got {words} at \['bad'\], which cannot be reduced"):
            exchange.reduce({"loss": 1.0, "bad": leaf}, op)
    with pytest.raises(ConfigError, match=r"a complex tensor \(complex64 \(2,\), sent as float64\) at the object"):
        exchange.reduce(torch.ones(2, dtype=torch.complex64), op)


@pytest.mark.parametrize("op", OPS)
def test_reduce_value_sends_every_number_as_float64(one_rank_group: None, op: str) -> None:
    # the header's digest says "a number, float64": an int sent as int64 bits would meet a float's on another rank
    for value in (3, 2.5, True, np.int64(4)):
        got = collectives.reduce_value(value, op)  # type: ignore[arg-type]
        assert got.dtype == torch.float64 and got.item() == float(value)


def test_a_session_reduce_of_a_numpy_scalar_or_0_dim_value_is_a_float() -> None:
    with Session(strategy="single") as session:
        for value in (np.float32(2.5), np.int64(3), 4, 2.5, torch.tensor(2.5), np.array(1.5), True):
            got = session.reduce(value, "sum")
            assert type(got) is float and got == float(value), value
        assert isinstance(session.reduce(np.ones(2, dtype=np.float32)), np.ndarray)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_split_between_processes_keeps_a_mapping_s_type(world: int) -> None:
    class Encoding(dict):  # type: ignore[type-arg]
        """A tokenizer's BatchEncoding: a dict with attributes of its own."""

        def __init__(self, data: dict[str, Any], note: str) -> None:
            super().__init__(data)
            self.note = note

    class Frozen(Mapping):  # type: ignore[type-arg]
        def __init__(self, data: dict[str, Any]) -> None:
            self._data = dict(data)

        def __getitem__(self, key: str) -> Any:
            return self._data[key]

        def __iter__(self) -> Iterator[str]:
            return iter(self._data)

        def __len__(self) -> int:
            return len(self._data)

    data = {"ids": list(range(5)), "mask": torch.arange(5)}
    for items in (defaultdict(list, data), OrderedDict(data), Encoding(data, "kept"), Frozen(data)):
        shares = [exchange.split_between_processes(items, world, rank) for rank in range(world)]
        assert all(type(share) is type(items) for share in shares)
        assert [i for share in shares for i in share["ids"]] == data["ids"]
        assert torch.equal(torch.cat([share["mask"] for share in shares]), data["mask"])
    share = exchange.split_between_processes(defaultdict(list, data), world, 0)
    assert share.default_factory is list and share["missing"] == []  # type: ignore[attr-defined]
    assert exchange.split_between_processes(Encoding(data, "kept"), world, 0).note == "kept"  # type: ignore[attr-defined]

    class Strict(Frozen):
        def __init__(self, data: dict[str, Any], required: int) -> None:
            super().__init__(data)

    with pytest.raises(ConfigError, match=r"cannot build a Strict from a dict of the shares .*pass dict\(items\)"):
        exchange.split_between_processes(Strict(data, 1), world, 0)
