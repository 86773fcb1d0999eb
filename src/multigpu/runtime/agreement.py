"""What one rank is about to send in a collective, so that the ranks agree on it before any data moves.

gloo and NCCL move bytes: an int32 tensor all-gathered with a float32 one on another rank is read as
float32 (its 1 becomes 1.4e-45), a tensor of another trailing shape is cut or overrun, and a rank whose
structure has one tensor more issues one collective more and leaves the others waiting. So each
collective of :mod:`multigpu.runtime.collectives` first exchanges a small fixed-size header (the sizes
it needs anyway, and the :meth:`Call.digest` of this module's description); when the digests differ,
every rank sees it in the same exchange, the ranks swap their descriptions, and every rank raises the
same :class:`~multigpu.errors.CollectiveMismatchError` naming each rank's dtype and shape
(:func:`mismatch_message`). This module only describes and explains; it communicates nothing.

Example:
    >>> call = Call.of("gather", [("['x']", torch.ones(2, 3))], match="trailing")
    >>> call.leaves[0].words()
    'float32 (2, 3)'
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch

# How the tensors of one leaf must agree between ranks: "trailing": one dtype and the sizes after dim 0
# (a gather: rows may differ); "all": dtype and shape (broadcast, reduce); "ndim": only the number of
# dimensions (a pad: its dim must name the same axis everywhere).
Match = Literal["trailing", "all", "ndim"]

_FIXES = {
    "trailing": "it concatenates on dim 0, so every rank needs one dtype and the same sizes after dim 0. "
    "Fix: convert every rank's tensor to one dtype (t.to(torch.float32)) and pad the dimensions that differ "
    "first (session.pad_across_processes(t, dim=1))",
    "all": "every rank needs one dtype and one shape. Fix: convert every rank's tensor to one dtype "
    "(t.to(torch.float32)) and give it the same shape everywhere (session.gather for per-rank sizes)",
    "ndim": "its dim must name the same axis on every rank. Fix: give every rank tensors with the same "
    "number of dimensions (unsqueeze or reshape them)",
}


@dataclass(frozen=True)
class Leaf:
    """One leaf of a rank's structure, in words.

    Attributes:
        path: where it sits (``['x'][0]``; "" for the object itself).
        kind: ``"tensor"``, ``"number"``, or the type name of a leaf that does not travel.
        dtype: the tensor's dtype (``"int32"``), "" for other leaves.
        shape: the tensor's shape.
        wire: the dtype it travels in when that is not ``dtype`` (a reduce sums int32 as int64).
    """

    path: str
    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    wire: str = ""

    @property
    def sends(self) -> bool:
        """Whether this leaf travels (tensors and numbers do; other leaves stay as they are)."""
        return self.kind in ("tensor", "number")

    def words(self) -> str:
        """``int32 (3, 2)``, ``a number (float64)``, or ``a str`` (a leaf that does not travel)."""
        if self.kind == "number":
            return f"a number ({self.dtype})"
        if not self.sends:
            return "None" if self.kind == "NoneType" else f"a {self.kind}"
        shape = "(" + ", ".join(str(s) for s in self.shape) + ("," if len(self.shape) == 1 else "") + ")"
        wire = f", sent as {self.wire}" if self.wire and self.wire != self.dtype else ""
        return f"{self.dtype} {shape}{wire}"

    def agreed(self, match: Match) -> tuple[Any, ...]:
        """The part of this leaf every rank must have the same, under ``match``."""
        if not self.sends:
            return (self.path, "-")
        kind = self.wire or self.dtype
        if match == "trailing":
            return (self.path, kind, len(self.shape), self.shape[1:])
        if match == "ndim":
            return (self.path, "tensor", len(self.shape))
        return (self.path, kind, self.shape)


@dataclass(frozen=True)
class Call:
    """One rank's side of a collective: its operation and the leaves it sends.

    Attributes:
        operation: what the collective does, with what must agree (``"broadcast from rank 1"``).
        leaves: every leaf of the structure, tensors or not, in flatten order.
        match: how the leaves' tensors must agree (see ``Match``).
    """

    operation: str
    leaves: tuple[Leaf, ...]
    match: Match = "all"

    @classmethod
    def of(cls, operation: str, leaves: Sequence[tuple[str, Any]], *, match: Match = "all") -> Call:
        """The call over ``(path, value)`` leaves: tensors are described, anything else named by its type."""
        return cls(operation, tuple(describe(path, value) for path, value in leaves), match)

    @cached_property
    def digest(self) -> int:
        """63 bits that are equal on two ranks when their calls agree (the same in every process: no salt)."""
        text = repr((self.operation, self.match, [leaf.agreed(self.match) for leaf in self.leaves]))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def describe(path: str, value: Any, *, wire: torch.dtype | None = None) -> Leaf:
    """``value`` as a :class:`Leaf` (a tensor's dtype and shape; anything else its type's name)."""
    if isinstance(value, torch.Tensor):
        name = _dtype_name(value.dtype)
        return Leaf(path, "tensor", name, tuple(value.shape), _dtype_name(wire) if wire is not None else "")
    return Leaf(path, type(value).__name__)


def number(path: str, value: Any) -> Leaf:
    """A Python or numpy number that travels as float64."""
    return Leaf(path, "number", type(value).__name__, (), "float64")


def mismatch_message(calls: Sequence[Call], rank: int) -> str:
    """Why the ranks' ``calls`` do not fit together, naming each rank's side and the fix (the same text on every rank).

    Example:
        >>> a = Call.of("gather", [("", torch.ones(2, dtype=torch.int32))], match="trailing")
        >>> b = Call.of("gather", [("", torch.ones(2, 3))], match="trailing")
        >>> print(mismatch_message([a, b], 0).splitlines()[1])
          rank 0: int32 (2,)
    """
    where = f"(seen on rank {rank})"
    operations = [c.operation for c in calls]
    if len(set(operations)) > 1:
        return _message(
            f"the ranks called different collectives {where}",
            operations,
            "Fix: every rank must call the same collectives in the same order, with the same src and dim "
            "(look for one inside 'if rank == 0')",
        )
    call = calls[0]
    places = [[(leaf.path, leaf.sends) for leaf in c.leaves] for c in calls]
    if any(p != places[0] for p in places):
        index = _first_difference(places)
        return _message(
            f"{call.operation} got structures that differ between the ranks at leaf #{index} {where}",
            [f"{_at(c, index)} ({_leaves(len(c.leaves))} in all)" for c in calls],
            "Fix: pass the same structure on every rank (the same keys, list lengths, and tensors in the "
            "same places); send a value that only some ranks have with gather_object",
        )
    index = _first_difference([[leaf.agreed(call.match) for leaf in c.leaves] for c in calls])
    path = call.leaves[index].path or "the object itself"
    return _message(
        f"{call.operation} got tensors that do not fit together at {path} {where}",
        [c.leaves[index].words() for c in calls],
        f"{call.operation.split(' ')[0]}: {_FIXES[call.match]}",
    )


def _message(head: str, sides: Sequence[str], fix: str) -> str:
    """``head:``, then each rank's side on its own line, then the fix."""
    return "\n".join([f"{head}:", *(f"  rank {r}: {side}" for r, side in enumerate(sides)), fix])


def _first_difference(lists: Sequence[Sequence[Any]]) -> int:
    longest = max(len(items) for items in lists)
    return next((i for i in range(longest) if len({items[i] if i < len(items) else None for items in lists}) > 1), 0)


def _leaves(count: int) -> str:
    return f"{count} leaf" if count == 1 else f"{count} leaves"


def _at(call: Call, index: int) -> str:
    if index >= len(call.leaves):
        return "nothing there"
    leaf = call.leaves[index]
    return f"{leaf.path or 'the object itself'} is {leaf.words()}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
