"""Collectives a training loop needs on top of DDP: metric reduction and per-sample gathers.

Each function is a thin use of torch.distributed (never a re-implementation) and works outside a
process group too (one process: the value is already the answer), so a training script calls
them the same way under every strategy. Inside a process group **every rank must call them**, in
the same order: each is a collective and a rank that skips one leaves the others waiting until
the process group's timeout.

Every collective multigpu issues passes through :func:`issuing` (one door): it notes the collective in
this rank's ledger, checks under ``--debug`` that every rank issues the same one
(:mod:`multigpu.runtime.tracking`), and explains a timed-out or broken collective
(:mod:`multigpu.runtime.collective_failures`). New collectives go through it too. Four stay outside
on purpose: the pre-emption flag's asynchronous all-reduce (:mod:`multigpu.runtime.preemption`: a
fingerprint exchange would make it blocking), the collectives that the DDP profiler and the
planner's calibration time (the door's cost would be in their figures), and those of a checkpoint
written in the background, on a group of its own (:func:`multigpu.checkpoint.ranks.on_group`: a
thread beside the training loop keeps no order with it; their failures are still explained). DDP's bucketed all-reduce
is entered as one collective per ``session.backward``; its buckets are torch's, checked by
``TORCH_DISTRIBUTED_DEBUG``.

No collective here trusts a peer's shapes or dtypes: each first all-gathers a small fixed-size header
(:func:`agree`) holding the sizes it needs anyway and the digest of what this rank sends
(:mod:`multigpu.runtime.agreement`), so ranks that pass tensors of another dtype, shape or structure
all raise :class:`~multigpu.errors.CollectiveMismatchError` naming each rank's, in the same exchange,
instead of reading each other's bytes wrong. A reduction small enough (:data:`PAYLOAD` numbers) travels
in the header itself: one collective, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist

from multigpu.devices import backend_device_type
from multigpu.errors import CollectiveMismatchError, ConfigError
from multigpu.runtime import tracking
from multigpu.runtime.agreement import Call, describe, mismatch_message, number
from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.world import global_rank, in_process_group, world_size

ReduceOp = Literal["mean", "sum", "max", "min"]

_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}
PAYLOAD = 30  # numbers a header carries: sizes, or a small reduction's values (int64 bit patterns)
_MAGIC = 0x6D756C7469677075  # "multigpu": a header met by anything else is another collective


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


def reduce_value(value: float | torch.Tensor, op: ReduceOp = "mean", *, what: str = "") -> torch.Tensor:
    """Reduce a metric across every process (mean, sum, max or min). Every rank must call it.

    Args:
        value: a number or tensor (any device); tensors are reduced elementwise.
        op: ``"mean"`` (the default: average over processes), ``"sum"``, ``"max"`` or ``"min"``.
        what: what the value is ("the end-of-data flag"), for the ledger and for the agreement: ranks
            that reduce different things at the same point are refused by name instead of mixing them.

    Returns:
        The reduced value as a float64 tensor on the CPU, identical on every rank (a 0-dim tensor
        for a number); outside a process group, ``value`` itself as such a tensor. Integer (and
        bool) tensors reduced by sum, max or min come back as int64 instead, exact beyond 2**53.

    Raises:
        ConfigError: ``op`` is no reduction, or ``value`` is complex (on every rank).
        CollectiveMismatchError: the ranks passed values of another shape or integer-ness (on every rank).

    Example:
        >>> float(reduce_value(2.5))   # one process: unchanged
        2.5
    """
    if isinstance(value, torch.Tensor):
        tensor, leaf = value, describe("", value, wire=wire_dtype(value, op))
    else:  # a number travels as float64 whatever its type: one rank's int 0 meets another's 0.5
        tensor, leaf = torch.tensor(float(value), dtype=torch.float64), number("", value)
    operation = f"reduce ({op}) of {what}" if what else f"reduce ({op})"
    (reduced,) = reduce_tensors([tensor], op, Call(operation, (leaf,)))
    return reduced


def wire_dtype(tensor: torch.Tensor, op: ReduceOp) -> torch.dtype:
    """What ``tensor`` is reduced in: int64 for an integer (or bool) sum, max or min, float64 otherwise.

    float64 keeps the digits of sums of many float32 losses; int64 keeps integers float64 would round past
    2**53 (a mean of them is a fraction: float64).
    """
    exact = op != "mean" and not (tensor.is_floating_point() or tensor.is_complex())
    return torch.int64 if exact else torch.float64


def reduce_tensors(tensors: Sequence[torch.Tensor], op: ReduceOp, call: Call) -> list[torch.Tensor]:
    """Each of ``tensors`` reduced elementwise over every rank, as :func:`reduce_value` does; ``call`` describes them.

    One collective when they hold at most :data:`PAYLOAD` numbers together (they travel in the header),
    else the header and one all-reduce per tensor. Every rank must call it.
    """
    if op not in _OPS:
        raise ConfigError(f"op={op!r} is not a reduction; use one of {sorted(_OPS)}")
    # a complex tensor is refused once the ranks agree; until then zeros of its shape stand in for it
    work = [
        t.detach().to("cpu", wire_dtype(t, op)) if not t.is_complex() else torch.zeros(t.shape, dtype=torch.float64)
        for t in tensors
    ]
    if not in_process_group():
        _refuse_complex(tensors, call)
        return work
    small = sum(t.numel() for t in work) <= PAYLOAD
    payload = torch.cat([t.flatten().view(torch.int64) for t in work]) if small and work else torch.zeros(0)
    rows = agree(call, payload.tolist() if small else ())
    _refuse_complex(tensors, call)  # after the agreement: the dtypes agree, so every rank refuses
    if small:
        return _reduce_rows(rows, work, op)
    out = []
    for tensor in work:
        device_copy = tensor.to(_collective_device())
        with issuing(call.operation, [device_copy]):
            dist.all_reduce(device_copy, op=getattr(dist.ReduceOp, _OPS[op]))  # note: a sync point across ranks
        if op == "mean":
            device_copy /= world_size()
        out.append(device_copy.cpu())
    return out


def _reduce_rows(rows: torch.Tensor, work: Sequence[torch.Tensor], op: ReduceOp) -> list[torch.Tensor]:
    """The reductions of every rank's values, read from the headers (every rank adds them in rank order: equal results)."""
    out, start = [], 0
    for tensor in work:
        values = rows[:, start : start + tensor.numel()].contiguous().view(tensor.dtype)
        start += tensor.numel()
        if op in ("sum", "mean"):
            reduced = values.sum(0) / values.shape[0] if op == "mean" else values.sum(0)
        else:
            reduced = values.amax(0) if op == "max" else values.amin(0)
        out.append(reduced.reshape(tensor.shape))
    return out


def _refuse_complex(tensors: Sequence[torch.Tensor], call: Call) -> None:
    for tensor, leaf in zip(tensors, (leaf for leaf in call.leaves if leaf.sends)):
        if tensor.is_complex():
            raise ConfigError(
                f"{call.operation} got a complex tensor ({leaf.words()}) at {leaf.path or 'the object itself'}; "
                "reduce its real and imaginary parts apart (t.real, t.imag) and combine them"
            )


def all_agree_min(count: int, what: str = "a count") -> int:
    """The smallest ``count`` over every process (the number of steps all ranks can take).

    Every rank must call it. Outside a process group returns ``count``.
    """
    return int(reduce_value(count, "min", what=what).item())


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
        ConfigError: on every rank, some rank's ``values`` and ``indices`` disagree in length, an index
            is outside ``[0, total)``, or some index in ``[0, total)`` was evaluated by no rank.
        CollectiveMismatchError: on every rank, the ranks' values differ in dtype or trailing shape, or
            their ``total`` differs.

    Example:
        >>> gather_by_index(torch.tensor([5., 6.]), torch.tensor([1, 0]), 2)
        tensor([6., 5.])
    """
    values, indices = values.detach(), indices.detach().long()
    operation = f"gather_by_index of {total} results"
    call = Call.of(operation, [("values", values), ("indices", indices)], match="trailing")
    sizes = agree(call, [values.shape[0], indices.shape[0]])
    # checked after the agreement, from every rank's counts and indices: every rank refuses alike
    for rank, (rows, count) in enumerate(sizes.tolist()):
        if rows != count:
            raise ConfigError(
                f"rank {rank}'s values has {rows} rows but indices has {count}; pass one index per result row"
            )
    all_values = gather_agreed_rows(values, sizes[:, 0].tolist())
    all_indices = gather_agreed_rows(indices, sizes[:, 1].tolist())
    for rank, idx in enumerate(all_indices):
        outside = idx[(idx < 0) | (idx >= total)]
        if len(outside):  # a negative index would wrap around and overwrite another sample's result
            raise ConfigError(
                f"rank {rank} passed dataset indices {outside[:5].tolist()} outside [0, {total}); pass each "
                "result's index in the dataset (build_eval_sampler's), and total=len(dataset)"
            )
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


def gather_rows(tensor: torch.Tensor, *, call: Call | None = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` in rank order, on the CPU; the first dimension may differ per rank.

    Every rank must call it, with tensors of one dtype and equal trailing dimensions: the ranks agree on
    that with the row counts (``call`` describes the whole structure ``tensor`` is a leaf of; default:
    ``tensor`` alone) and refuse a difference on every rank.

    Raises:
        CollectiveMismatchError: the ranks' tensors differ in dtype or trailing shape (naming each).

    Example:
        >>> [t.tolist() for t in gather_rows(torch.tensor([1, 2]))]   # one process
        [[1, 2]]
    """
    tensor = tensor.detach()
    if not in_process_group():
        return [tensor.cpu()]
    call = call or Call.of("gather", [("", tensor)], match="trailing")
    return gather_agreed_rows(tensor, agree(call, [tensor.shape[0]])[:, 0].tolist())


def gather_agreed_rows(tensor: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Every rank's ``tensor``, whose row counts ``sizes`` the ranks have agreed with :func:`agree`. Every rank must call it.

    The rows travel as bytes, so every dtype does (gloo has no int16, uint16 or complex of its own).
    """
    if not in_process_group():
        return [tensor.detach().cpu()]
    device = _collective_device()
    local = _as_bytes(tensor.detach().to(device))
    padded = torch.zeros((max(sizes), *local.shape[1:]), dtype=torch.uint8, device=device)
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in sizes]
    with issuing("gather (rows, padded)", [padded]):
        dist.all_gather(gathered, padded)  # note: a sync point across ranks
    return [_from_bytes(g[:size].cpu(), tensor.dtype, (size, *tensor.shape[1:])) for g, size in zip(gathered, sizes)]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes: ``[*shape, itemsize]`` uint8 (its rows stay rows)."""
    return tensor.contiguous().unsqueeze(-1).view(torch.uint8)


def _from_bytes(data: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return data.contiguous().view(dtype).reshape(tuple(shape))


def broadcast_tensor(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``tensor`` on every rank (a copy, on ``tensor``'s device). Every rank must call it,
    with a tensor of the same shape and dtype (refused on every rank otherwise)."""
    (out,) = broadcast_tensors([tensor], src, Call.of(f"broadcast from rank {src!r}", [("", tensor)]))
    return out


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, call: Call) -> list[torch.Tensor]:
    """Rank ``src``'s ``tensors`` on every rank, once the ranks agree that ``call`` (their description) matches.

    Every rank must call it. Raises :class:`CollectiveMismatchError` on every rank when a shape, dtype or
    the structure differs.
    """
    if in_process_group():
        agree(call)
    check_src(src)  # after the agreement, which included src: every rank refuses alike
    if not in_process_group():
        return [t.detach().clone() for t in tensors]
    out = []
    for tensor in tensors:
        work = _as_bytes(tensor.detach().to(_collective_device())).clone()  # bytes: every dtype travels
        with issuing(f"broadcast from rank {src}", [work]):
            dist.broadcast(work, src=src)  # note: a sync point across ranks
        out.append(_from_bytes(work, tensor.dtype, tensor.shape).to(tensor.device))
    return out


def check_src(src: object) -> None:
    """Refuse a ``src`` that names no rank of this world (one process: a world of one).

    Raises:
        ConfigError: ``src`` is not an int in ``[0, world size)`` (a negative index, a bool, rank 1 of one).
    """
    size = world_size() if in_process_group() else 1
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
        raise ConfigError(f"src={src!r} is not a rank of this world of {size}; use 0 <= src < world size")


def agree(call: Call, numbers: Sequence[int] = ()) -> torch.Tensor:
    """Every rank's ``numbers`` (``[world_size, len(numbers)]`` int64 on the CPU), once every rank's ``call`` matches.

    One all-gather of a fixed-size header per :data:`PAYLOAD` numbers (at least one): the numbers and
    ``call``'s digest. When a digest differs every rank sees it, the ranks swap their calls (one more
    exchange, only then) and every rank raises the same error. Every rank must call it, with as many numbers.

    Raises:
        CollectiveMismatchError: the ranks' calls differ (operation, structure, dtype or shape), naming each.

    Example:
        >>> agree(Call("gather", ()), [3]).tolist()   # one process
        [[3]]
    """
    numbers = [int(n) for n in numbers]
    if not in_process_group():
        return torch.tensor([numbers], dtype=torch.int64).reshape(1, len(numbers))
    device = _collective_device()
    rows = []
    for start in range(0, max(1, len(numbers)), PAYLOAD):
        chunk = numbers[start : start + PAYLOAD]
        header = torch.zeros(2 + PAYLOAD, dtype=torch.int64)
        header[0], header[1] = _MAGIC, call.digest
        header[2 : 2 + len(chunk)] = torch.tensor(chunk, dtype=torch.int64)
        header = header.to(device)
        gathered = [torch.empty_like(header) for _ in range(world_size())]
        with issuing(call.operation, _fingerprint(call), ragged=call.match == "trailing"):
            dist.all_gather(gathered, header)  # note: a sync point across ranks
        everyone = torch.stack(gathered).cpu()
        _check_headers(everyone, call)
        rows.append(everyone[:, 2 : 2 + len(chunk)])
    return torch.cat(rows, dim=1)


def _fingerprint(call: Call) -> list[torch.Tensor]:
    """What ``--debug`` compares for the header exchange: the tensors the call sends (as shapes without data,
    in the dtype they travel in), not the header; none for a pad, whose other dimensions may differ."""
    if not tracking.debug_enabled() or call.match == "ndim":
        return []
    return [
        torch.empty(leaf.shape, dtype=getattr(torch, leaf.wire or leaf.dtype), device="meta")
        for leaf in call.leaves
        if leaf.sends
    ]


def _check_headers(everyone: torch.Tensor, call: Call) -> None:
    """Raise on every rank when a header is not one (another collective) or a digest differs (another call)."""
    strangers = [rank for rank, magic in enumerate(everyone[:, 0].tolist()) if magic != _MAGIC]
    if strangers:
        raise CollectiveMismatchError(
            f"{call.operation}: ranks {strangers} are inside another collective (seen on rank {global_rank()}). "
            "Fix: every rank must call the same collectives in the same order; multigpu launch --debug names "
            "each rank's call"
        )
    if len(set(everyone[:, 1].tolist())) == 1:
        return
    calls: list[Any] = [None] * world_size()
    with issuing(f"{call.operation} (describe the disagreement)"):
        dist.all_gather_object(calls, call)  # note: only when the ranks disagree; every rank is here
    raise CollectiveMismatchError(mismatch_message(calls, global_rank()))


def _collective_device() -> torch.device:
    """Where collective buffers must live: this process's device under a device backend (NCCL), else the CPU."""
    kind = backend_device_type(str(dist.get_backend()))
    return kind.current_device() if kind is not None else torch.device("cpu")
