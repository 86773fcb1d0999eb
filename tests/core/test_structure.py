"""Walking nested inputs and outputs once (multigpu.core.structure): which objects are containers,
how they are rebuilt, and the paths that error messages name."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, deque, namedtuple
from typing import Any

import torch

from multigpu.core.structure import flatten, iter_tensors, map_leaves, structure_difference

Pair = namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    note: str = "n"
    derived: int = dataclasses.field(init=False, default=0)  # recomputed, not carried


@dataclasses.dataclass
class ModelOutputLike(OrderedDict):  # transformers' ModelOutput: an OrderedDict that is a dataclass
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class Batch(dict):  # a tokenizer's BatchEncoding: a dict subclass
    pass


class Row(tuple):
    __slots__ = ()


class Counts(defaultdict):
    pass


def test_every_container_keeps_its_type_and_its_leaves_their_order() -> None:
    x, y = torch.ones(2), torch.zeros(3)
    counts = Counts(list, {"c": y})
    obj = (
        [Pair(x, "s"), Output(x)],
        {"batch": Batch(ids=x), "row": Row([y, None])},
        ModelOutputLike(loss=y),
        counts,
    )
    flat = flatten(obj)
    assert [type(leaf).__name__ for leaf in flat.leaves] == [
        *("Tensor", "str", "Tensor", "str"),  # Pair, then Output's init fields
        *("Tensor", "Tensor", "NoneType"),  # Batch, Row
        *("Tensor", "NoneType"),  # ModelOutputLike: loss, logits
        "Tensor",  # Counts
    ]
    rebuilt = flat.rebuild()
    assert type(rebuilt[0][0]) is Pair and type(rebuilt[0][1]) is Output
    assert type(rebuilt[1]["batch"]) is Batch and type(rebuilt[1]["row"]) is Row
    assert type(rebuilt[2]) is ModelOutputLike and rebuilt[2].loss is y
    assert type(rebuilt[3]) is Counts and rebuilt[3].default_factory is list
    assert list(iter_tensors(obj)) == [leaf for leaf in flat.leaves if isinstance(leaf, torch.Tensor)]


def test_deques_and_arbitrary_objects_are_leaves() -> None:
    queue, marker = deque([torch.ones(1)]), object()
    assert flatten((queue, marker, None, "text")).leaves == [queue, marker, None, "text"]


def test_paths_read_like_the_expression_that_reaches_the_leaf() -> None:
    obj = ((torch.ones(1),), {"x": Output(torch.ones(1))}, Pair(1, 2))
    flat = flatten(obj)
    paths = [flat.path(i) for i in range(len(flat.leaves))]
    assert paths == ["[0][0]", "[1]['x'].logits", "[1]['x'].note", "[2][0]", "[2][1]"]
    assert map_leaves(lambda leaf, path: path, {"k": [0, 0]}) == {"k": ["['k'][0]", "['k'][1]"]}


def test_child_is_a_slice_of_the_leaves() -> None:
    flat = flatten(((torch.ones(1), 2), {"k": 3}, None))
    assert flat.child(0).leaves[1] == 2 and flat.child(1).rebuild() == {"k": 3}
    assert flat.child(2).rebuild() is None


def test_structure_difference_names_where_the_structures_part() -> None:
    same: Any = [{"a": (1, 2)}, {"a": (3, 4)}]
    assert structure_difference(same) is None
    assert structure_difference([{"a": 1}, {"b": 1}]) == (
        "replica outputs differ at the top level: keys ['a'] vs ['b']; every replica must return the same keys"
    )
    assert structure_difference([{"a": (1, 2)}, {"a": (1,)}]) == (
        "replica outputs differ at ['a']: length 2 vs 1; every replica must return the same structure"
    )
    assert structure_difference([[Pair(1, 2)], [(1, 2)]]) == (
        "replica outputs differ at [0]: Pair vs tuple; every replica must return the same structure"
    )
