"""Collectives a training loop needs on top of DDP: metric reduction and per-sample gathers.

Each function is a thin use of torch.distributed (never a re-implementation) and works outside a
process group too (one process: the value is already the answer), so a training script calls
them the same way under every strategy. Inside a process group **every rank must call them**, in
the same order: each is a collective and a rank that skips one leaves the others waiting until
the process group's timeout.

Every collective multigpu issues passes through :func:`issuing` (one door): it notes the collective in
this rank's ledger, checks under ``--debug`` that every rank issues the same one
(:mod:`multigpu.runtime.tracking`), and explains a timed-out or broken collective
(:mod:`multigpu.runtime.collective_failures`). New collectives go through it too. Three stay outside
on purpose: the pre-emption flag's asynchronous all-reduce (:mod:`multigpu.runtime.preemption`: a
fingerprint exchange would make it blocking), and the collectives that the DDP profiler and the
planner's calibration time (the door's cost would be in their figures). DDP's bucketed all-reduce
is entered as one collective per ``session.backward``; its buckets are torch's, checked by
``TORCH_DISTRIBUTED_DEBUG``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch
import torch.distributed as dist

from multigpu.devices import backend_device_type
from multigpu.errors import ConfigError
from multigpu.runtime import tracking
from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.world import in_process_group, world_size

ReduceOp = Literal["mean", "sum", "max", "min"]

_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


@contextmanager
def issuing(operation: str, tensors: Sequence[torch.Tensor] = (), *, ragged: bool = False) -> Iterator[None]:
    """The block issues one collective ``operation`` over ``tensors``: the one door of multigpu's collectives.

    Notes it in this rank's ledger, checks under ``--debug`` that every rank issues the same one
    (``ragged``: the first dimension may differ), and re-raises a timeout or a lost peer explained.
    Every rank must enter it, in the same order (outside a process group it only counts).

    Example:
        >>> with issuing("barrier"):
        ...     pass
    """
    with explain_collective_failures(operation):
        tracking.enter(operation, tensors, ragged=ragged)
        yield


def barrier() -> None:
    """Wait until every rank arrives (no-op outside a process group). Every rank must call it."""
    if in_process_group():
        with issuing("barrier"):
            dist.barrier()


def reduce_value(value: float | torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
    """Reduce a metric across every process (mean, sum, max or min). Every rank must call it.

    Args:
        value: a number or tensor (any device); tensors are reduced elementwise.
        op: ``"mean"`` (the default: average over processes), ``"sum"``, ``"max"`` or ``"min"``.

    Returns:
        The reduced value as a float64 tensor on the CPU, identical on every rank (a 0-dim tensor
        for a number); outside a process group, ``value`` itself as such a tensor. Integer (and
        bool) tensors reduced by sum, max or min come back as int64 instead, exact beyond 2**53.

    Example:
        >>> float(reduce_value(2.5))   # one process: unchanged
        2.5
    """
    if op not in _OPS:
        raise ConfigError(f"op={op!r} is not a reduction; use one of {sorted(_OPS)}")
    tensor = torch.as_tensor(value).detach()
    # Reduce in float64 so that sums of many float32 losses keep their digits; integer tensors in
    # int64, which float64 would round past 2**53 (a mean of them is a fraction: float64). Numbers
    # stay float64 whatever their type, so a rank's int 0 meets another's 0.5 in one dtype.
    exact = isinstance(value, torch.Tensor) and op != "mean" and not (value.is_floating_point() or value.is_complex())
    dtype = torch.int64 if exact else torch.float64
    if not in_process_group():
        return tensor.to("cpu", dtype)
    work = tensor.to(_collective_device(), dtype).clone()
    with issuing(f"reduce ({op})", [work]):
        dist.all_reduce(work, op=getattr(dist.ReduceOp, _OPS[op]))  # note: a sync point across ranks
    if op == "mean":
        work /= world_size()
    return work.cpu()


def all_agree_min(count: int) -> int:
    """The smallest ``count`` over every process (the number of steps all ranks can take).

    Every rank must call it. Outside a process group returns ``count``.
    """
    return int(reduce_value(count, "min").item())


def gather_by_index(values: torch.Tensor, indices: torch.Tensor, total: int) -> torch.Tensor:
    """Put per-sample results from every rank back in dataset order, each sample exactly once.

    Ranks evaluate different samples (and, when the dataset does not divide by the world size,
    a few samples twice as padding); this gathers every rank's ``(indices, values)`` and writes
    each value at its index, so padding duplicates collapse. Every rank must call it.

    Args:
        values: ``[n_local, ...]`` results of this rank's samples.
        indices: ``[n_local]`` dataset indices of those samples.
        total: the dataset's length; the result has exactly this many rows.

    Returns:
        ``[total, ...]`` on the CPU, the same on every rank.

    Raises:
        ConfigError: ``values`` and ``indices`` disagree in length, or some index in
            ``[0, total)`` was evaluated by no rank.

    Example:
        >>> gather_by_index(torch.tensor([5., 6.]), torch.tensor([1, 0]), 2)
        tensor([6., 5.])
    """
    if values.shape[0] != indices.shape[0]:
        raise ConfigError(
            f"values has {values.shape[0]} rows but indices has {indices.shape[0]}; pass one index per result row"
        )
    all_values, all_indices = _all_gather_rows(values.detach()), _all_gather_rows(indices.detach().long())
    out = torch.empty((total, *values.shape[1:]), dtype=values.dtype)
    seen = torch.zeros(total, dtype=torch.bool)
    for vals, idx in zip(all_values, all_indices):
        out[idx] = vals
        seen[idx] = True
    if not bool(seen.all()):
        missing = torch.nonzero(~seen).flatten()[:5].tolist()
        raise ConfigError(
            f"no rank produced results for dataset indices {missing}...; evaluate with a sampler that "
            "covers the whole dataset (build_eval_sampler) on every rank"
        )
    return out


def gather_rows(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` in rank order, on the CPU; the first dimension may differ per rank.

    Every rank must call it, with tensors of one dtype and equal trailing dimensions.

    Example:
        >>> [t.tolist() for t in gather_rows(torch.tensor([1, 2]))]   # one process
        [[1, 2]]
    """
    return _all_gather_rows(tensor.detach())


def broadcast_tensor(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``tensor`` on every rank (a copy, on ``tensor``'s device). Every rank must call it,
    with a tensor of the same shape and dtype."""
    if not in_process_group():
        return tensor.detach().clone()
    if not 0 <= src < world_size():
        raise ConfigError(f"src={src} is not a rank of this world of {world_size()}; use 0 <= src < world size")
    work = tensor.detach().to(_collective_device()).contiguous().clone()
    with issuing(f"broadcast from rank {src}", [work]):
        dist.broadcast(work, src=src)  # note: a sync point across ranks
    return work.to(tensor.device)


def _all_gather_rows(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (row counts may differ), on the CPU, in rank order."""
    if not in_process_group():
        return [tensor.cpu()]
    device = _collective_device()
    local = tensor.to(device).contiguous()
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size())]
    with issuing("gather (rows)", [local], ragged=True):
        dist.all_gather(sizes, torch.tensor([local.shape[0]], device=device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=device)
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in sizes]
    with issuing("gather (rows, padded)", [padded]):
        dist.all_gather(gathered, padded)  # note: a sync point across ranks
    return [g[: int(s.item())].cpu() for g, s in zip(gathered, sizes)]


def _collective_device() -> torch.device:
    """Where collective buffers must live: this process's device under a device backend (NCCL), else the CPU."""
    kind = backend_device_type(str(dist.get_backend()))
    return kind.current_device() if kind is not None else torch.device("cpu")
