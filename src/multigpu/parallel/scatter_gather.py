"""The engine's scatter and gather, on flattened structures and any device.

:func:`split_inputs` splits every tensor leaf on ``dim`` with the same chunk sizes; tensors
without that dim (scalars) and non-tensors are shared by every replica. A negative ``dim`` counts
from each tensor's last dimension, as in nn.DataParallel. Sparse COO inputs are split too; other
sparse layouts are refused with the conversion that works. :func:`merge_outputs` concatenates
tensors on ``dim`` on the output device, combines 0-dim outputs (a per-replica loss) by the scalar
rule, and keeps container types. Both are plain differentiable tensor ops: the gradient of a
gathered output flows back to the replica that produced it.

Both take the flat form (:class:`multigpu.core.structure.Flat`) that DataParallel makes once per
step, so neither walks a structure. torch's functional ``scatter`` and ``gather`` (the public
names, with torch's signatures) are in :mod:`multigpu.parallel.functional` and build on these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from multigpu.core import comm
from multigpu.core.structure import Flat, structure_difference
from multigpu.devices import ReplicaDevice
from multigpu.errors import GatherError, ScatterError

ScalarRule = Literal["mean", "sum", "stack"]


def has_dim(tensor: torch.Tensor, dim: int) -> bool:
    """Whether ``tensor`` has dimension ``dim`` (negative: counted from its last one)."""
    return tensor.dim() > dim if dim >= 0 else tensor.dim() >= -dim


def batch_size(inputs: Flat, dim: int) -> int | None:
    """The size of ``dim`` shared by every scatterable tensor in ``inputs`` (None: nothing to split).

    Raises:
        ScatterError: two tensors disagree on the size of ``dim``, or the batch is empty.
    """
    found: tuple[int, int] | None = None  # (size, leaf index)
    for index, leaf in enumerate(inputs.leaves):
        if not isinstance(leaf, torch.Tensor) or not has_dim(leaf, dim):
            continue
        if leaf.layout not in (torch.strided, torch.sparse_coo):
            raise ScatterError(
                f"input{inputs.path(index)} is a {leaf.layout} tensor, which cannot be split into chunks along "
                f"dim {dim}; pass it as a dense tensor (x.to_dense()) or a sparse COO tensor (x.to_sparse_coo())"
            )
        size = leaf.size(dim)
        if found is None:
            found = (size, index)
        elif size != found[0]:
            raise ScatterError(
                f"inputs disagree on the batch size along dim {dim}: input{inputs.path(found[1])} has {found[0]}, "
                f"input{inputs.path(index)} has {size} (shape {tuple(leaf.shape)}); {_same_batch_fix(found[0], size)}"
            )
    if found is None:
        return None
    if found[0] == 0:
        raise ScatterError(
            f"input{inputs.path(found[1])} has an empty batch (size 0 along dim {dim}); skip empty batches "
            "before calling the model, e.g. DataLoader(..., drop_last=True)"
        )
    return found[0]


def _same_batch_fix(first: int, other: int) -> str:
    """The fix for two batch sizes that disagree: a size-1 tensor meant to broadcast (``position_ids`` of shape
    ``(1, T)``) is expanded to the batch; a tensor every replica needs whole has no batch dimension at all."""
    if 1 in (first, other):
        return (
            f"expand the one of size 1 to the batch (x.expand({max(first, other)}, ...), a view) so each replica "
            "gets its rows, or pass tensors of one batch size"
        )
    return (
        "pass tensors of one batch size; a tensor every replica needs whole must not have the batch dimension "
        "(with dim=0: a 0-dim tensor; else fewer dimensions than dim) or can be a buffer of the module"
    )


def even_chunk_sizes(batch: int, replicas: int) -> list[int]:
    """Split ``batch`` over ``replicas`` as evenly as possible, the first replicas taking the remainder.

    A batch smaller than the number of replicas leaves the last replicas with 0 (they do not run).

    Example:
        >>> even_chunk_sizes(65, 2), even_chunk_sizes(3, 4)
        ([33, 32], [1, 1, 1, 0])
    """
    base, extra = divmod(batch, replicas)
    return [base + (1 if i < extra else 0) for i in range(replicas)]


def split_inputs(
    inputs: Flat, chunk_sizes: Sequence[int], devices: Sequence[ReplicaDevice], dim: int
) -> list[list[Any]]:
    """Split the leaves of ``inputs`` into one row of leaves per replica (only replicas with a non-zero chunk).

    Args:
        inputs: the flattened inputs (:func:`multigpu.core.structure.flatten`).
        chunk_sizes: one size per device in ``devices``; zeros are skipped.
        devices: the replica devices, aligned with ``chunk_sizes``.
        dim: the batch dimension.

    Returns:
        ``rows[i]``: active replica i's leaves, aligned with ``inputs.leaves``, its tensors on that
        replica's device (``inputs.rebuild(rows[i])`` is its structure). A tensor met twice is split once.
    """
    active = [(size, dev) for size, dev in zip(chunk_sizes, devices) if size > 0]
    sizes = [size for size, _ in active]
    targets = [dev.device for _, dev in active]
    pieces: dict[int, list[torch.Tensor]] = {}
    rows: list[list[Any]] = [[] for _ in active]
    for leaf in inputs.leaves:
        if not isinstance(leaf, torch.Tensor):
            for row in rows:
                row.append(leaf)
            continue
        split = pieces.get(id(leaf))
        if split is None:
            if has_dim(leaf, dim):
                split = comm.split_to_devices(leaf, sizes, targets, dim)
            else:
                split = comm.copy_to_devices(leaf, targets)
            pieces[id(leaf)] = split
        for row, piece in zip(rows, split):
            row.append(piece)
    return rows


def merge_outputs(
    outputs: Sequence[Flat],
    chunk_sizes: Sequence[int],
    target: torch.device,
    dim: int,
    scalar_rule: ScalarRule = "mean",
) -> Any:
    """Combine the flattened replica outputs into one structure on ``target``.

    Tensors are concatenated on ``dim``. 0-dim tensors (a loss each replica computed on its
    chunk) follow ``scalar_rule``: ``"mean"`` weights each by its chunk size, which equals a
    mean-reduced loss over the whole batch; ``"sum"`` adds them (sum-reduced losses);
    ``"stack"`` returns the vector of per-replica values as nn.DataParallel does. ``None``
    stays ``None``; other non-tensors are kept when every replica agrees, else listed per replica.

    Raises:
        GatherError: the replicas' outputs differ in structure, in type, or in shape other than
            along ``dim`` (naming the replicas and shapes).
    """
    first = outputs[0]
    if len(outputs) == 1 and scalar_rule != "stack":
        return first.rebuild([_move(leaf, target) for leaf in first.leaves])
    for other in outputs[1:]:
        if other.spec != first.spec:
            found = structure_difference([out.rebuild() for out in outputs])
            raise GatherError(found or f"replica outputs differ in structure: {first.spec} vs {other.spec}")
    combined = [
        _combine([out.leaves[j] for out in outputs], first, j, chunk_sizes, target, dim, scalar_rule)
        for j in range(len(first.leaves))
    ]
    return first.rebuild(combined)


def _combine(
    leaves: list[Any],
    first: Flat,
    index: int,
    chunk_sizes: Sequence[int],
    target: torch.device,
    dim: int,
    rule: ScalarRule,
) -> Any:
    """One leaf position across replicas: tensors concatenated (or scalars combined), others kept."""
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not tensors:
        return leaves[0] if all(_same(leaves[0], leaf) for leaf in leaves) else list(leaves)
    if len(tensors) != len(leaves):
        raise GatherError(
            f"output{first.path(index)} is a tensor on some replicas and not on others; return the same types"
        )
    _check_shapes(tensors, first, index, dim)
    moved = [t.to(target) for t in tensors]
    if moved[0].dim() == 0:
        return _combine_scalars(moved, chunk_sizes, rule)
    return torch.cat(moved, dim)


def _check_shapes(tensors: list[torch.Tensor], first: Flat, index: int, dim: int) -> None:
    """Tensors that can be concatenated on ``dim`` (or 0-dim scalars), or a GatherError naming them."""
    shapes = [tuple(t.shape) for t in tensors]
    if len({len(shape) for shape in shapes}) > 1:
        path, listed = _where(first, index, shapes)
        raise GatherError(
            f"output{path} has a different number of dims on different replicas ({listed}); "
            "every replica must return tensors of the same rank"
        )
    if not shapes[0]:
        return
    if not has_dim(tensors[0], dim):
        path = first.path(index)
        raise GatherError(
            f"output{path} has shape {shapes[0]}, too few dims to gather on dim {dim}; "
            "return a batch-shaped tensor or a 0-dim scalar"
        )
    axis = dim % len(shapes[0])
    if len({shape[:axis] + shape[axis + 1 :] for shape in shapes}) > 1:
        path, listed = _where(first, index, shapes)
        raise GatherError(
            f"output{path} differs in shape across replicas in more than the batch dim {dim} ({listed}); "
            "replicas must return tensors that differ only in their batch dimension"
        )


def _where(first: Flat, index: int, shapes: list[tuple[int, ...]]) -> tuple[str, str]:
    return first.path(index), ", ".join(f"replica {i}: {shape}" for i, shape in enumerate(shapes))


def _combine_scalars(values: list[torch.Tensor], chunk_sizes: Sequence[int], rule: ScalarRule) -> torch.Tensor:
    stacked = torch.stack(values)
    if rule == "stack":
        return stacked
    if rule == "sum":
        return stacked.sum()
    if not stacked.is_floating_point():
        stacked = stacked.double()
    weights = torch.tensor(chunk_sizes, dtype=stacked.dtype, device=stacked.device) / sum(chunk_sizes)
    return (stacked * weights).sum()


def _move(leaf: Any, target: torch.device) -> Any:
    return leaf.to(target) if isinstance(leaf, torch.Tensor) else leaf


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # objects whose == is not a plain bool (arrays): treat as different
        return False
