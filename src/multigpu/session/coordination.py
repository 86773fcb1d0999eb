"""Rules the loop toolkit shares: who goes first, a flag any rank raises, metrics without
the sharding's repeats, uneven inputs, and each rank's own random stream.

:class:`~multigpu.session.toolkit.Toolkit` (the Session's helper methods) delegates to these; each rule is
written once:

- :func:`main_first` runs a block on the (local) main process before the others (a download, a cache
  built once per node); every rank passes one barrier.
- :class:`Trigger`: any rank sets it, every rank sees it at the same :meth:`Trigger.check` (early
  stopping decided by one rank's condition).
- :class:`MetricsPosition`: where an evaluation loop over a session loader stands, so
  ``gather_for_metrics`` puts the ranks' rows in the one-device order and drops the rows the
  sharding repeated to fill the last global batch.
- :func:`join_uneven` is torch's ``Join`` over the DDP model: a rank out of batches shadows the
  others' gradient all-reduces while they go on.
- :func:`rank_seed` reseeds each rank's torch generator after the model is built (identical
  initial weights, independent dropout masks).
"""

from __future__ import annotations

import copy
import hashlib
import pickle
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from multigpu.core.structure import iter_tensors
from multigpu.errors import CollectiveTimeoutError, ConfigError, PeerExitedError
from multigpu.runtime import world
from multigpu.runtime.collectives import reduce_value
from multigpu.runtime.data import EpochLoader
from multigpu.runtime.exchange import gather_pieces, interleave

_open_blocks: list[str] = []  # the main_first blocks this process is inside, outermost first


@contextmanager
def main_first(is_first: bool, kind: str = "main_process_first") -> Iterator[None]:
    """The block runs on the processes with ``is_first`` before the others start it. Every rank must enter it.

    The others wait in one small all-reduce until the first ones have finished the block. When a first
    process raises inside it, it still joins that all-reduce, saying so: the others raise
    :class:`~multigpu.errors.PeerExitedError` instead of running the block without it (or waiting
    until the collective timeout). A block nested inside one of the same ``kind`` is part of the outer
    one (the outer block already runs the first processes before the others: no collective); one of
    the other kind is refused, since the ranks inside the outer block at once are not the ones it orders.

    Raises:
        ConfigError: a block of the other kind is nested inside this one.
        PeerExitedError: on the others, a first process raised inside the block.
    """
    if _open_blocks:
        if _open_blocks[0] != kind:
            raise ConfigError(
                f"{kind}() inside {_open_blocks[0]}(): the two order different ranks, so they cannot nest. Fix: "
                f"use one of them for the whole block, or put the {kind}() block after the other one"
            )
        _open_blocks.append(kind)
        try:
            yield  # nested: the outer block orders the ranks
        finally:
            _open_blocks.pop()
        return
    if not is_first and _first_failed():  # note: a sync point; the first processes reach it after the block
        raise PeerExitedError(
            f"the main process raised inside {kind}(), so this rank does not run the block without it; "
            "that error, on the main process, is the cause (this one is a consequence)"
        )
    _open_blocks.append(kind)
    try:
        yield
    except Exception as exc:
        if is_first and not isinstance(exc, (CollectiveTimeoutError, PeerExitedError)):
            _first_failed(True)  # releases the others with the news (a broken group could not carry it)
        raise
    finally:
        _open_blocks.pop()
    if is_first and _first_failed(False):  # another node's first process failed (local_main_process_first)
        raise PeerExitedError(
            f"another node's first process raised inside {kind}(), so the run stops here too; that error is "
            "the cause (this one is a consequence)"
        )


def _first_failed(failed: bool = False) -> bool:
    """Whether any first process failed inside the block: one all-reduce (max) every rank joins."""
    return bool(reduce_value(1 if failed else 0, "max", what="the main process's end of its block").item())


class Trigger:
    """A flag any rank may raise; :meth:`check` tells every rank whether any did, and lowers it."""

    def __init__(self) -> None:
        self._raised = False

    def set(self) -> None:
        """Raise the flag on this rank (communicates nothing)."""
        self._raised = True

    def check(self) -> bool:
        """Whether any rank raised the flag since the last check (then lowered everywhere). Every rank must call it."""
        # note: a sync point, one all-reduce of a number
        raised = bool(reduce_value(1 if self._raised else 0, "max", what="the trigger").item())
        if raised:
            self._raised = False
        return raised


class MetricsPosition:
    """How many samples of the current session loader's epoch have been gathered, to cut the sharding's repeats.

    Args:
        loader: the iterable ``session.batches`` walks: an :class:`EpochLoader` from ``build_loader`` /
            ``setup_dataloader`` is recognised (its positions are strided between ranks); anything
            else is gathered in rank order with nothing dropped.
    """

    def __init__(self, loader: object) -> None:
        self.strided = isinstance(loader, EpochLoader)
        self.total = _epoch_samples(loader) if isinstance(loader, EpochLoader) else None
        self.seen = 0  # samples of the epoch before the current batch (a resumed epoch skips some)
        self.batch_rows = 0  # the current batch's rows over all ranks, as its gathers found them
        if isinstance(loader, EpochLoader) and loader.sampler is not None:
            self.seen = loader.pending_skip * (loader.loader.batch_size or 1) * loader.sampler.num_replicas

    def next_batch(self) -> None:
        """The loop moved to its next batch: the current one's rows count as seen (once, however many
        times it was gathered: predictions and labels are often gathered apart)."""
        self.seen += self.batch_rows
        self.batch_rows = 0

    def gather(self, obj: Any) -> Any:
        """``obj``'s tensors and lists of samples from every rank, in one-device order, less the repeats
        past the epoch's end.

        A plain list or tuple that holds no tensor (generated strings, sample ids), or a numpy array, passed as
        ``obj``, as a value of a mapping or an item of a list or tuple passed, holds one item (row) per sample:
        it travels pickled, in the same all-gathers as the tensors, and comes back arranged and cut as their rows.

        Raises:
            CollectiveMismatchError: on every rank, the ranks' structures, dtypes or trailing shapes differ.
        """
        lifted, packed = _lift_sample_lists(obj)
        flat, pieces = gather_pieces(lifted, "gather_for_metrics")
        unpacked = {
            i: [pickle.loads(piece.numpy().tobytes()) for piece in got]
            for i, (leaf, got) in enumerate(zip(flat.leaves, pieces))
            if got is not None and id(leaf) in packed
        }
        counts = [sum(len(p) for p in got) for i, got in enumerate(pieces) if got is not None and i not in unpacked]
        rows = max(counts + [sum(len(items) for items in lists) for lists in unpacked.values()], default=0)
        keep = self.keep(rows)
        leaves = []
        for i, (leaf, got) in enumerate(zip(flat.leaves, pieces)):
            if i in unpacked:
                leaves.append(packed[id(leaf)](self.arrange_items(unpacked[i])[:keep]))
            else:
                leaves.append(leaf if got is None else self.arrange(got)[:keep])
        return flat.rebuild(leaves)

    def arrange(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's rows of one batch in the one-device order (strided positions), or in rank order."""
        return interleave(pieces) if self.strided else torch.cat(pieces)

    def arrange_items(self, lists: list[list[Any]]) -> list[Any]:
        """:meth:`arrange` for every rank's list of per-sample items."""
        if not self.strided:
            return [item for items in lists for item in items]
        longest = max((len(items) for items in lists), default=0)
        return [items[i] for i in range(longest) for items in lists if i < len(items)]

    def keep(self, rows: int) -> int:
        """How many of the current batch's gathered ``rows`` are real samples (the rest repeat the epoch's first)."""
        self.batch_rows = max(self.batch_rows, rows)
        return rows if self.total is None else max(0, min(rows, self.total - self.seen))


def _lift_sample_lists(obj: Any) -> tuple[Any, dict[int, Callable[[list[Any]], Any]]]:
    """``obj`` with each plain list or tuple of per-sample items (one that holds no tensor), and each numpy
    array of rows, replaced by a uint8 tensor of its pickle: ``obj`` itself, a mapping's value, or an item of a
    list or tuple; and, by the tensor's ``id``, what builds the gathered items back into their kind."""
    packed: dict[int, Callable[[list[Any]], Any]] = {}

    def lift(value: Any) -> Any:
        if isinstance(value, np.ndarray) and value.ndim:
            build: Callable[[list[Any]], Any] = partial(_rows_to_array, empty=value[:0])
        elif type(value) in (list, tuple) and not any(True for _ in iter_tensors(value)):
            build = type(value)
        else:
            return value
        tensor = torch.frombuffer(bytearray(pickle.dumps(list(value))), dtype=torch.uint8)
        packed[id(tensor)] = build
        return tensor

    if type(obj) in (list, tuple) and any(True for _ in iter_tensors(obj)):
        return type(obj)(lift(item) for item in obj), packed
    if isinstance(obj, MutableMapping):
        if not any(type(v) in (list, tuple) or isinstance(v, np.ndarray) for v in obj.values()):
            return obj, packed  # nothing to lift: the mapping as it is (its own type kept)
        lifted = copy.copy(obj)
        for key, value in obj.items():
            lifted[key] = lift(value)
        return lifted, packed
    return lift(obj), packed


def _rows_to_array(rows: list[Any], *, empty: np.ndarray) -> np.ndarray:
    return np.stack(rows) if rows else empty


def _epoch_samples(loader: EpochLoader[Any]) -> int | None:
    """The real samples one epoch of ``loader`` holds over all ranks (repeats excluded); None when unknown."""
    sampler = loader.sampler
    if sampler is None:
        return None  # an iterable dataset: ranks stop at the shortest, nothing repeated
    count = len(sampler.dataset)  # type: ignore[arg-type]
    if loader.loader.drop_last:
        batch = loader.loader.batch_size or 1
        return (count // (batch * sampler.num_replicas)) * batch * sampler.num_replicas
    return count


def join_uneven(model: nn.Module, *, divide_by_initial_world_size: bool = True) -> Any:
    """torch's ``Join`` over ``model``'s DDP wrapper; a no-op context in one process.

    Raises:
        ConfigError: several processes train but ``model`` is not DDP-wrapped (e.g. fsdp, which
            cannot shadow its collectives).
    """
    if not world.in_process_group() or world.world_size() == 1:
        return nullcontext()
    ddp = model
    while not isinstance(ddp, DistributedDataParallel) and isinstance(getattr(ddp, "_orig_mod", None), nn.Module):
        ddp = cast(nn.Module, ddp._orig_mod)  # torch.compile's wrapper
    if not isinstance(ddp, DistributedDataParallel):
        raise ConfigError(
            f"session.join needs the model returned by session.setup_model under ddp, got a {type(model).__name__}: "
            "only DDP can shadow the collectives of ranks that ran out of batches (fsdp cannot; use even batches)"
        )
    return Join([ddp], divide_by_initial_world_size=divide_by_initial_world_size)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s torch generator once the model is built (independent per rank).

    Example:
        >>> rank_seed(0, 0) != rank_seed(0, 1)
        True
    """
    digest = hashlib.blake2b(f"multigpu-rank:{seed}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def seed_rank_streams(seed: int, rank: int) -> None:
    """Reseed torch's generators (CPU and every accelerator) with :func:`rank_seed`."""
    torch.manual_seed(rank_seed(seed, rank))
