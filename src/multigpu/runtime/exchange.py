"""Moving tensors, nested structures and Python objects between ranks: gather, broadcast, reduce, pad, split.

The toolkit a training loop written for Accelerate reaches for, built on the primitives of
:mod:`multigpu.runtime.collectives` (``agree``, ``gather_agreed_rows``, which all-gathers rows whose
count differs per rank, ``reduce_tensors`` and ``broadcast_tensors``), so every collective here goes
through that module. Objects travel
pickled, as bytes in a uint8 tensor. Outside a process group each function returns what one
process would (the value itself, or a list of one).

Inside a process group **every rank must call each of them**, in the same order, with the same
structure (the same containers and keys; tensors of one dtype and trailing shape per leaf). That is
checked, not trusted: each first agrees on a digest of its structure, dtypes and shapes with the sizes
it exchanges anyway (:func:`~multigpu.runtime.collectives.agree`), and ranks that differ all raise
:class:`~multigpu.errors.CollectiveMismatchError` naming each rank's side. :func:`split_between_processes`
is the exception: it communicates nothing.

Example:
    >>> gather({"n": torch.tensor([1, 2])})   # one process: the structure, rows concatenated
    {'n': tensor([1, 2])}
"""

from __future__ import annotations

import copy
import numbers
import pickle
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from multigpu.core.structure import Flat, flatten, leaf_paths
from multigpu.errors import ConfigError
from multigpu.runtime.agreement import Call, describe, number
from multigpu.runtime.collectives import (
    ReduceOp,
    agree,
    broadcast_tensors,
    check_src,
    gather_agreed_rows,
    gather_rows,
    reduce_tensors,
    wire_dtype,
)
from multigpu.runtime.world import in_process_group

T = TypeVar("T")


def gather(obj: Any) -> Any:
    """``obj`` with each tensor replaced by every rank's, concatenated on dim 0 in rank order.

    The first dimension may differ per rank (the rest must agree); a 0-dim tensor counts as one
    row, so a scalar gathers into ``[world_size]``. Non-tensor leaves are kept as they are. Results
    are on the tensor's own device. Every rank must call it.

    Raises:
        CollectiveMismatchError: on every rank, when the ranks' structures differ (keys, lengths, where
            the tensors are) or a tensor's dtype or trailing shape does (naming each rank's).

    Example:
        >>> gather(torch.tensor(3.0))
        tensor([3.])
    """
    flat, pieces = gather_pieces(obj, "gather")
    return flat.rebuild([leaf if got is None else torch.cat(got) for leaf, got in zip(flat.leaves, pieces)])


def gather_pieces(obj: Any, operation: str) -> tuple[Flat, list[list[torch.Tensor] | None]]:
    """``obj`` flattened, and for each tensor leaf every rank's piece (a 0-dim tensor as one row) in rank
    order on the leaf's device (None for other leaves). The ranks agree on the structure, dtypes and
    trailing shapes with the row counts: one exchange, then one all-gather per tensor. Every rank must call it.
    """
    flat = flatten(obj)
    rows = [_as_rows(leaf) for leaf in flat.leaves]
    call = Call.of(operation, list(zip(leaf_paths(flat.spec), rows)), match="trailing")
    tensors = [r for r in rows if isinstance(r, torch.Tensor)]
    sizes = agree(call, [t.shape[0] for t in tensors]) if in_process_group() else None
    found: list[list[torch.Tensor] | None] = []
    index = 0  # of the tensor leaf
    for leaf in rows:
        if not isinstance(leaf, torch.Tensor):
            found.append(None)
            continue
        column = [leaf.shape[0]] if sizes is None else sizes[:, index].tolist()
        found.append([piece.to(leaf.device) for piece in gather_agreed_rows(leaf, column)])
        index += 1
    return flat, found


def _as_rows(leaf: Any) -> Any:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    return leaf.detach().reshape(1) if leaf.dim() == 0 else leaf.detach()


def gather_object(obj: Any, operation: str = "gather_object") -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (a list of ``world_size``). Every rank must call it.

    Example:
        >>> gather_object({"seen": 3})
        [{'seen': 3}]
    """
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    call = Call.of(operation, [("", data)], match="trailing")
    return [pickle.loads(piece.numpy().tobytes()) for piece in gather_rows(data, call=call)]


def broadcast(obj: T, src: int = 0) -> T:
    """``obj`` with each tensor replaced by rank ``src``'s (same shapes and dtypes on every rank). Every rank must call it.

    Raises:
        ConfigError: ``src`` names no rank.
        CollectiveMismatchError: on every rank, when the structures, a dtype or a shape differ, or
            the ranks name different ``src`` (naming each rank's).

    Example:
        >>> broadcast([torch.ones(2)], src=0)
        [tensor([1., 1.])]
    """
    flat = flatten(obj)
    call = Call.of(f"broadcast from rank {src!r}", list(zip(leaf_paths(flat.spec), flat.leaves)))
    tensors = iter(broadcast_tensors(list(flat.tensors()), src, call))
    return flat.rebuild([next(tensors) if torch.is_tensor(leaf) else leaf for leaf in flat.leaves])  # type: ignore[no-any-return]


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s picklable ``obj`` on every rank (other ranks may pass anything, e.g. None). Every rank must call it.

    Example:
        >>> broadcast_object({"lr": 0.1})
        {'lr': 0.1}
    """
    everyone = gather_object(obj, f"broadcast_object from rank {src!r}")
    check_src(src)  # after the exchange, which agreed on src: every rank refuses alike
    return everyone[src]  # type: ignore[no-any-return]


def reduce(obj: Any, op: ReduceOp = "mean") -> Any:
    """``obj`` with each tensor, number and numpy array reduced over every rank, elementwise.

    Tensors keep their shape, device and, where the result fits, dtype (a mean of integers is
    float32); numpy arrays come back as numpy arrays by the same rule; numbers (Python's and numpy's
    scalars, bools too) come back as Python floats. All of them travel together: one collective when they
    hold at most ``collectives.PAYLOAD`` numbers. Every rank must call it.

    Raises:
        ConfigError: on every rank, ``obj`` holds a leaf that cannot be reduced (a string, None, an
            object array, a complex number), naming where.
        CollectiveMismatchError: on every rank, the ranks' structures or a leaf's shape differ, or a
            leaf is an integer tensor on one rank and a floating one on another (naming each rank's).

    Example:
        >>> reduce({"loss": torch.tensor([1.0, 3.0]), "n": 4})
        {'loss': tensor([1., 3.]), 'n': 4.0}
    """
    flat = flatten(obj)
    paths = leaf_paths(flat.spec)
    values = [_reducible(leaf) for leaf in flat.leaves]
    leaves = []
    for path, leaf, value in zip(paths, flat.leaves, values):
        if value is None:
            leaves.append(describe(path, leaf))
        elif isinstance(leaf, (torch.Tensor, np.ndarray)):
            leaves.append(describe(path, value, wire=wire_dtype(value, op)))
        else:
            leaves.append(number(path, leaf))
    call = Call(f"reduce ({op})", tuple(leaves))
    reduced = iter(reduce_tensors([v for v in values if v is not None], op, call))
    for leaf in leaves:  # after the collective, which agreed these leaves: every rank refuses alike
        if not leaf.sends:
            raise ConfigError(
                f"reduce got {leaf.words()} at {leaf.path or 'the object itself'}, which cannot be reduced; reduce "
                "takes tensors, numbers and numeric numpy arrays (send other values with gather_object)"
            )
    return flat.rebuild(
        [_restore(leaf, next(reduced), op) if v is not None else leaf for leaf, v in zip(flat.leaves, values)]
    )


def _reducible(leaf: Any) -> torch.Tensor | None:
    """``leaf`` as the tensor reduce sends (a number as float64), or None when it cannot be reduced."""
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, np.ndarray):
        return torch.from_numpy(np.array(leaf, copy=True)) if leaf.dtype.kind in "biuf" else None
    if isinstance(leaf, np.generic):
        return torch.tensor(float(leaf), dtype=torch.float64) if leaf.dtype.kind in "biuf" else None
    if isinstance(leaf, numbers.Real):
        return torch.tensor(float(leaf), dtype=torch.float64)
    return None


def _restore(leaf: Any, reduced: torch.Tensor, op: ReduceOp) -> Any:
    """The reduced value in the form of ``leaf``: a tensor on its device, a numpy array, or a Python float."""
    if isinstance(leaf, torch.Tensor):
        dtype = leaf.dtype if leaf.is_floating_point() or op != "mean" else torch.float32
        return reduced.to(leaf.device, dtype)
    if isinstance(leaf, np.ndarray):
        kept = leaf.dtype if leaf.dtype.kind == "f" or op != "mean" else np.dtype(np.float32)
        return reduced.numpy().astype(kept)
    return float(reduced.item())


def pad_across_processes(obj: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """``obj`` with each tensor padded on ``dim`` to the largest size any rank has there.

    Padding is ``pad_index``, after the data (before it with ``pad_first``); tensors already that
    large, and 0-dim ones, come back unchanged. Every rank must call it (one small exchange for the
    sizes of up to ``collectives.PAYLOAD`` tensors).

    Raises:
        ConfigError: ``dim`` is outside a tensor's dimensions (on every rank).
        CollectiveMismatchError: on every rank, the ranks' structures differ or a tensor's number of
            dimensions does (naming each rank's).

    Example:
        >>> pad_across_processes(torch.tensor([1, 2]), dim=0)   # one process: already the largest
        tensor([1, 2])
    """
    flat = flatten(obj)
    call = Call.of(f"pad_across_processes on dim {dim}", list(zip(leaf_paths(flat.spec), flat.leaves)), match="ndim")
    tensors = list(flat.tensors())
    sizes = agree(call, [_size_at(t, dim) for t in tensors]).amax(0).tolist()
    for tensor in tensors:  # after the agreement on the number of dimensions: every rank refuses alike
        if tensor.dim() and not -tensor.dim() <= dim < tensor.dim():
            raise ConfigError(
                f"pad_across_processes got dim={dim} for a tensor of shape {tuple(tensor.shape)}; "
                f"use a dim in [{-tensor.dim()}, {tensor.dim() - 1}]"
            )
    longest = iter(sizes)
    return flat.rebuild(
        [
            _pad(leaf, dim, next(longest), pad_index, pad_first) if torch.is_tensor(leaf) else leaf
            for leaf in flat.leaves
        ]
    )


def _size_at(tensor: torch.Tensor, dim: int) -> int:
    return int(tensor.shape[dim]) if tensor.dim() and -tensor.dim() <= dim < tensor.dim() else 0


def _pad(tensor: torch.Tensor, dim: int, longest: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    if tensor.dim() == 0 or longest == tensor.shape[dim]:
        return tensor
    dim = dim % tensor.dim()
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

    Shares differ by at most one item (the first ranks take the extra ones); a list, tuple or tensor comes
    back in kind, any other sequence (a range, a deque) as a list. With
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
        shares = {k: split_between_processes(v, world, rank, apply_padding=apply_padding) for k, v in items.items()}
        return _same_mapping(items, shares)
    count = _length(items)
    if not torch.is_tensor(items) and type(items) not in (list, tuple):
        items = list(items)  # a range, a deque: their items, as a list (a range's share cannot be padded in kind)
    start, end = share_bounds(count, world, rank)
    share = items[start:end]
    if apply_padding:
        longest = share_bounds(count, world, 0)[1]
        missing = longest - (end - start)
        if missing and count:
            last = items[-1:]
            if torch.is_tensor(share):
                share = torch.cat([share, *([last] * missing)])
            else:
                share = share + type(share)(list(last) * missing)
    return share


def _same_mapping(items: Mapping[Any, Any], shares: dict[Any, Any]) -> Mapping[Any, Any]:
    """``shares`` in a mapping of ``items``' type: a copy of a mutable one refilled (a defaultdict keeps its
    factory, a BatchEncoding its attributes), else the type built from a dict."""
    if isinstance(items, MutableMapping):
        out = copy.copy(items)
        out.clear()
        out.update(shares)
        return out
    try:
        return type(items)(shares)  # type: ignore[call-arg]
    except TypeError as exc:
        raise ConfigError(
            f"split_between_processes cannot build a {type(items).__name__} from a dict of the shares ({exc}); "
            "pass dict(items)"
        ) from None


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
