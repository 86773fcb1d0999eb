"""Moving tensors, nested structures and Python objects between ranks: gather, broadcast, reduce, pad, split.

The toolkit a training loop written for Accelerate reaches for, built on the two primitives of
:mod:`multigpu.runtime.collectives` (:func:`~multigpu.runtime.collectives.gather_rows`, which
all-gathers rows whose count differs per rank, and :func:`~multigpu.runtime.collectives.reduce_value`)
plus its ``broadcast_tensor``, so every collective here goes through that module. Objects travel
pickled, as bytes in a uint8 tensor. Outside a process group each function returns what one
process would (the value itself, or a list of one).

Inside a process group **every rank must call each of them**, in the same order, with the same
structure (the same containers and keys; tensors of one dtype and trailing shape per leaf).
:func:`split_between_processes` is the exception: it communicates nothing.

Example:
    >>> gather({"n": torch.tensor([1, 2])})   # one process: the structure, rows concatenated
    {'n': tensor([1, 2])}
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from multigpu.core.structure import map_leaves
from multigpu.errors import ConfigError
from multigpu.runtime.collectives import ReduceOp, broadcast_tensor, gather_rows, reduce_value
from multigpu.runtime.world import in_process_group, world_size

T = TypeVar("T")


def gather(obj: Any) -> Any:
    """``obj`` with each tensor replaced by every rank's, concatenated on dim 0 in rank order.

    The first dimension may differ per rank (the rest must agree); a 0-dim tensor counts as one
    row, so a scalar gathers into ``[world_size]``. Non-tensor leaves are kept as they are. Results
    are on the tensor's own device. Every rank must call it.

    Example:
        >>> gather(torch.tensor(3.0))
        tensor([3.])
    """
    return map_leaves(lambda leaf, _: _gather_tensor(leaf) if torch.is_tensor(leaf) else leaf, obj)


def gather_per_rank(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (a 0-dim one as one row), in rank order, on ``tensor``'s device. Every rank must call it."""
    rows = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    return [piece.to(tensor.device) for piece in gather_rows(rows)]


def _gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat(gather_per_rank(tensor))


def gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (a list of ``world_size``). Every rank must call it.

    Example:
        >>> gather_object({"seen": 3})
        [{'seen': 3}]
    """
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return [pickle.loads(piece.numpy().tobytes()) for piece in gather_rows(data)]


def broadcast(obj: T, src: int = 0) -> T:
    """``obj`` with each tensor replaced by rank ``src``'s (same shapes and dtypes on every rank). Every rank must call it.

    Example:
        >>> broadcast([torch.ones(2)], src=0)
        [tensor([1., 1.])]
    """
    check_src(src)
    return map_leaves(lambda leaf, _: broadcast_tensor(leaf, src) if torch.is_tensor(leaf) else leaf, obj)  # type: ignore[no-any-return]


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s picklable ``obj`` on every rank (other ranks may pass anything, e.g. None). Every rank must call it.

    Example:
        >>> broadcast_object({"lr": 0.1})
        {'lr': 0.1}
    """
    check_src(src)
    return gather_object(obj)[src]  # type: ignore[no-any-return]


def check_src(src: object) -> None:
    """Refuse a ``src`` that names no rank of this world (one process: a world of one), before any collective.

    Raises:
        ConfigError: ``src`` is not an int in ``[0, world size)`` (a negative index, a bool, rank 1 of one).
    """
    size = world_size() if in_process_group() else 1
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
        raise ConfigError(f"src={src!r} is not a rank of this world of {size}; use 0 <= src < world size")


def reduce(obj: Any, op: ReduceOp = "mean") -> Any:
    """``obj`` with each tensor (and number) reduced over every rank, elementwise.

    Tensors keep their shape, device and, where the result fits, dtype (a mean of integers is
    float32); numbers come back as Python floats. Every rank must call it.

    Example:
        >>> reduce({"loss": torch.tensor([1.0, 3.0]), "n": 4})
        {'loss': tensor([1., 3.]), 'n': 4.0}
    """
    return map_leaves(lambda leaf, _: _reduce_leaf(leaf, op), obj)


def _reduce_leaf(leaf: Any, op: ReduceOp) -> Any:
    if torch.is_tensor(leaf):
        reduced = reduce_value(leaf, op)
        dtype = leaf.dtype if leaf.is_floating_point() or op != "mean" else torch.float32
        return reduced.to(leaf.device, dtype)
    if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
        return float(reduce_value(leaf, op).item())
    return leaf


def pad_across_processes(obj: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """``obj`` with each tensor padded on ``dim`` to the largest size any rank has there.

    Padding is ``pad_index``, after the data (before it with ``pad_first``); tensors already that
    large, and 0-dim ones, come back unchanged. Every rank must call it (one small all-reduce per tensor).

    Example:
        >>> pad_across_processes(torch.tensor([1, 2]), dim=0)   # one process: already the largest
        tensor([1, 2])
    """
    return map_leaves(lambda leaf, _: _pad(leaf, dim, pad_index, pad_first) if torch.is_tensor(leaf) else leaf, obj)


def _pad(tensor: torch.Tensor, dim: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    if tensor.dim() == 0:
        return tensor
    if not -tensor.dim() <= dim < tensor.dim():
        raise ConfigError(
            f"pad_across_processes got dim={dim} for a tensor of shape {tuple(tensor.shape)}; "
            f"use a dim in [{-tensor.dim()}, {tensor.dim() - 1}]"
        )
    dim = dim % tensor.dim()
    longest = int(reduce_value(tensor.shape[dim], "max").item())
    if longest == tensor.shape[dim]:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = longest
    out = tensor.new_full(shape, pad_index)
    start = longest - tensor.shape[dim] if pad_first else 0
    out.narrow(dim, start, tensor.shape[dim]).copy_(tensor)
    return out


def share_bounds(count: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous share of ``count`` items: the first ``count % world`` ranks take one more.

    Example:
        >>> [share_bounds(5, 2, r) for r in (0, 1)]
        [(0, 3), (3, 5)]
    """
    per, extra = divmod(count, world)
    start = rank * per + min(rank, extra)
    return start, start + per + (1 if rank < extra else 0)


def split_between_processes(items: Any, world: int, rank: int, *, apply_padding: bool = False) -> Any:
    """Rank ``rank``'s contiguous share of ``items`` (a list, tuple, tensor, or a dict of such, split alike).

    Shares differ by at most one item (the first ranks take the extra ones). With
    ``apply_padding`` every share has the size of the largest, the short ones repeating the last
    item (drop the repeats after gathering). Communicates nothing.

    Raises:
        ConfigError: ``items`` is none of those, or a dict's values differ in length.

    Example:
        >>> split_between_processes(["a", "b", "c"], world=2, rank=1)
        ['c']
    """
    if isinstance(items, Mapping):
        lengths = {key: _length(value) for key, value in items.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigError(
                f"split_between_processes got a dict whose values differ in length ({lengths}); "
                "give every value one entry per item"
            )
        return type(items)(  # type: ignore[call-arg]
            {k: split_between_processes(v, world, rank, apply_padding=apply_padding) for k, v in items.items()}
        )
    start, end = share_bounds(_length(items), world, rank)
    share = items[start:end]
    if apply_padding:
        longest = share_bounds(_length(items), world, 0)[1]
        missing = longest - (end - start)
        if missing and _length(items):
            last = items[-1:]
            if torch.is_tensor(share):
                share = torch.cat([share, *([last] * missing)])
            else:
                share = share + type(share)(list(last) * missing)
    return share


def _length(items: Any) -> int:
    if torch.is_tensor(items):
        if items.dim() == 0:
            raise ConfigError("split_between_processes got a 0-dim tensor; give it a tensor of items on dim 0")
        return int(items.shape[0])
    if isinstance(items, Sequence) and not isinstance(items, (str, bytes)):
        return len(items)
    raise ConfigError(
        f"split_between_processes takes a list, tuple, tensor or a dict of them, got {type(items).__name__}"
    )


def interleave(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows of every rank's piece in the order one device would hold them when rank ``r`` took positions ``r, r+W, ...``.

    Row ``i`` of rank ``r`` is position ``i * W + r``; pieces may differ in length by the ranks that ran out.

    Example:
        >>> interleave([torch.tensor([0, 2, 4]), torch.tensor([1, 3])]).tolist()
        [0, 1, 2, 3, 4]
    """
    if not pieces:
        return torch.empty(0)
    if all(len(p) == len(pieces[0]) for p in pieces):
        return torch.stack(list(pieces), dim=1).flatten(0, 1)
    longest = max(len(p) for p in pieces)
    rows = [p[i] for i in range(longest) for p in pieces if i < len(p)]
    return torch.stack(rows) if rows else pieces[0][:0]
