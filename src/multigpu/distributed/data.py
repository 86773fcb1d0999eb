"""Sharded data: which samples each rank sees, per epoch, for training and for evaluation.

Policy (the same under every strategy, so one script gives the same global batches anywhere):

- **Training.** One seeded permutation of the dataset per epoch, identical on every rank
  (torch's ``DistributedSampler`` with ``set_epoch``). :class:`EpochLoader` sets the epoch each
  time iteration starts, so shuffles differ per epoch without the classic forgotten
  ``sampler.set_epoch(epoch)``. Rank ``r`` of ``W`` takes positions ``r, r+W, r+2W, ...`` and
  batches them by ``global_batch // W``; so global batch ``k`` is the same set of samples as the
  single-process batch ``k`` of the same permutation.
- **A dataset that does not divide.** The sampler pads the permutation with its first samples to
  a multiple of the world size, then the loader drops the incomplete last *global* batch
  (``drop_last=True``, the default): every rank takes the same number of full batches, and no
  padded sample is trained on unless the dataset is smaller than one global batch per rank.
  ``drop_last=False`` keeps the short last batch (with padding duplicates under DDP).
- **Evaluation.** No shuffle, padded to a multiple of the world size; per-sample results are
  gathered by dataset index so the padding collapses (:func:`multigpu.distributed.collectives.gather_by_index`):
  exactly ``len(dataset)`` results.
- **Uneven inputs** (an iterable whose length differs per rank): :func:`even_batches` lets all
  ranks agree on the shortest, so no rank waits forever in an all-reduce that another never joins.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from multigpu.distributed.collectives import all_agree_min, in_process_group, reduce_value
from multigpu.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """Which shard this process reads: ``rank`` of ``world_size`` (1 and 0 for one process)."""

    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank} of world_size={self.world_size}: need 0 <= rank < world_size >= 1")


def per_process_batch(global_batch: int, shard: ShardSpec) -> int:
    """The batch each process loads so that all processes together load ``global_batch``.

    Raises:
        ConfigError: ``global_batch`` does not divide by the world size (naming a value that does).

    Example:
        >>> per_process_batch(64, ShardSpec(world_size=2, rank=0))
        32
    """
    if global_batch < 1 or global_batch % shard.world_size:
        fixed = max(shard.world_size, global_batch - global_batch % shard.world_size)
        raise ConfigError(
            f"batch_size={global_batch} (the global batch) must be a positive multiple of the "
            f"world size {shard.world_size}; use batch_size={fixed}"
        )
    return global_batch // shard.world_size


def build_train_sampler(dataset: Sized, shard: ShardSpec, *, shuffle: bool = True, seed: int = 0) -> DistributedSampler:
    """The training sampler of this shard: one seeded permutation per epoch, shared by all ranks."""
    return DistributedSampler(
        dataset,  # type: ignore[arg-type]
        num_replicas=shard.world_size,
        rank=shard.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=False,
    )


def build_eval_sampler(dataset: Sized, shard: ShardSpec) -> DistributedSampler:
    """The evaluation sampler of this shard: dataset order, padded to a multiple of the world size."""
    return DistributedSampler(dataset, num_replicas=shard.world_size, rank=shard.rank, shuffle=False)  # type: ignore[arg-type]


class EpochLoader(Generic[T]):
    """A DataLoader over this rank's shard that sets the sampler's epoch every time it is iterated.

    Args:
        loader: the DataLoader, built on ``sampler``.
        sampler: its :class:`DistributedSampler`.

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.arange(8.0))
        >>> loader = build_epoch_loader(data, global_batch=4, shard=ShardSpec())
        >>> [len(list(loader)) for _ in range(2)], loader.epoch
        ([2, 2], 2)
    """

    def __init__(self, loader: DataLoader, sampler: DistributedSampler) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0  # the epoch the next iteration will use

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration use ``epoch``'s permutation (e.g. after resuming)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[T]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def build_epoch_loader(
    dataset: Dataset,
    *,
    global_batch: int,
    shard: ShardSpec,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    **loader_kwargs: Any,
) -> EpochLoader[Any]:
    """A training loader for this shard (see the module docstring for the policy).

    Args:
        dataset: a map-style dataset (has ``__len__``).
        global_batch: samples per step over all processes.
        shard: this process's shard.
        shuffle: a new seeded permutation every epoch.
        seed: the permutation seed (the same on every rank).
        drop_last: drop the incomplete last global batch (keeps every rank's batch count equal).
        **loader_kwargs: passed to DataLoader (``num_workers``, ``pin_memory``, ``collate_fn``...).

    Returns:
        An :class:`EpochLoader`.
    """
    if not isinstance(dataset, Sized):
        raise ConfigError(
            f"dataset {type(dataset).__name__} has no len(); a sharded loader needs a map-style dataset, "
            "or iterate your own loader through even_batches()"
        )
    batch = per_process_batch(global_batch, shard)
    sampler = build_train_sampler(dataset, shard, shuffle=shuffle, seed=seed)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=drop_last, **loader_kwargs)
    return EpochLoader(loader, sampler)


def even_batches(batches: Iterable[T]) -> Iterator[T]:
    """Yield batches until *any* rank runs out, so ranks with more batches do not hang the others.

    With a known ``len()`` the ranks agree once on the shortest length (one all-reduce); without,
    they agree before every batch (one small all-reduce per step). Batches beyond the shortest
    rank's are skipped. Every rank must call it, and iterate it to the end (or break on all ranks).

    Example:
        >>> list(even_batches([1, 2, 3]))   # one process: unchanged
        [1, 2, 3]
    """
    if not in_process_group():
        yield from batches
        return
    if isinstance(batches, Sized):
        steps = all_agree_min(len(batches))
        for step, batch in enumerate(batches):
            if step >= steps:
                return
            yield batch
        return
    iterator = iter(batches)
    while True:
        batch = next(iterator, _END)
        # note: one sync point per batch; every rank stops at the first rank's end
        if int(reduce_value(0 if batch is _END else 1, "min").item()) == 0:
            return
        yield batch  # type: ignore[misc]


_END: Any = object()


def shard_indices(dataset: Sized, shard: ShardSpec) -> torch.Tensor:
    """The dataset indices this rank evaluates, in order (see :func:`build_eval_sampler`)."""
    return torch.tensor(list(build_eval_sampler(dataset, shard)), dtype=torch.long)
