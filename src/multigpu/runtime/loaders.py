"""Your own DataLoader, sharded: rebuilt over its dataset so that each rank loads its part of every global batch.

A DataLoader built for one device walks the whole dataset; run as is in each of ``W`` ddp
processes, every process trains on every sample and the run silently takes ``W`` times the
steps it should. :func:`shard_dataloader` rebuilds such a loader for this rank and
:func:`check_sharded` refuses one that was not rebuilt. The policy:

- **Map-style dataset.** The loader's ``batch_size`` is the **global** batch; each rank loads
  ``batch_size // W``. Its ``RandomSampler`` (``shuffle=True``) or ``SequentialSampler`` becomes
  torch's ``DistributedSampler`` with the same shuffle, seeded by the session's seed plus the
  epoch, exactly what :func:`multigpu.runtime.data.build_epoch_loader` builds: one shared
  permutation per epoch, global batch ``k`` equal to one device's batch ``k``. The shuffle order
  therefore comes from the session's seed, not from the loader's ``generator`` (which is kept for
  the workers' seeds). ``drop_last`` keeps its meaning (see :mod:`multigpu.runtime.data`).
- **Iterable dataset.** Rank ``r`` takes the stream's items ``r, r+W, r+2W, ...`` (striding), in
  batches of ``batch_size // W``: global batch ``k`` is again one device's batch ``k``. Each
  DataLoader worker strides its own copy of the stream, so a dataset that splits its stream
  between workers (``get_worker_info``) keeps doing so. The ranks stop at the first rank's end
  (the Session agrees on it before each batch); with ``drop_last=True`` that is exactly one
  device's ``len(stream) // batch_size`` batches.
- **Kept** from the loader: ``collate_fn``, ``num_workers``, ``pin_memory``,
  ``pin_memory_device``, ``timeout``, ``worker_init_fn``, ``multiprocessing_context``,
  ``generator``, ``prefetch_factor``, ``persistent_workers``, ``in_order`` and ``drop_last``.
- **Refused** with a :class:`~multigpu.errors.ConfigError` that says what to do instead, because
  it cannot be kept: a DataLoader subclass (its own behaviour would be lost), a custom sampler or
  batch sampler (its order is not the shared per-epoch permutation; and it is not sharded for you as
  Accelerate's ``BatchSamplerShard`` does, because its own code draws the order, often from torch's
  global generator, which differs per rank after ``setup_model``: the ranks' shards would overlap
  and miss samples; shard it yourself and iterate it with ``session.batches``), a ``RandomSampler`` with
  replacement or its own ``num_samples``, ``batch_size=None`` (the dataset yields whole batches),
  and a loader that is already sharded by a ``DistributedSampler``.

Example:
    >>> loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=4, shuffle=True)
    >>> sharded = shard_dataloader(loader, ShardSpec(world_size=2, rank=0), seed=0)
    >>> [len(b) for (b,) in sharded]     # this rank's half of each global batch of 4
    [2, 2]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from multigpu.errors import ConfigError
from multigpu.runtime.data import EpochLoader, ShardSpec, build_epoch_loader, per_process_batch
from multigpu.runtime.resumable import loader_settings

# torch's samplers that never shard: a loader over one of them loads every sample on every rank.
_UNSHARDED = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
_FIX = "pass it through loader = session.setup_dataloader(loader) (its batch_size becomes the global batch)"


class StridedIterable(IterableDataset):  # type: ignore[type-arg]
    """Rank ``rank``'s items of ``dataset``'s stream: positions ``rank, rank + W, rank + 2W, ...``.

    Args:
        dataset: an iterable dataset.
        shard: this process's shard (``W`` = its world size).

    Example:
        >>> list(StridedIterable(range(7), ShardSpec(world_size=3, rank=1)))
        [1, 4]
    """

    def __init__(self, dataset: Any, shard: ShardSpec) -> None:
        self.dataset = dataset
        self.shard = shard

    def __iter__(self) -> Iterator[Any]:
        for position, item in enumerate(self.dataset):
            if position % self.shard.world_size == self.shard.rank:
                yield item


def shard_dataloader(loader: DataLoader, shard: ShardSpec, *, seed: int) -> EpochLoader[Any]:
    """``loader`` rebuilt for this rank (see the module docstring for what is kept and refused).

    Args:
        loader: a DataLoader written for one device; its batch size is the global batch.
        shard: this process's shard.
        seed: the shuffle seed, the same on every rank (the epoch is added each epoch).

    Returns:
        An :class:`~multigpu.runtime.data.EpochLoader` (it advances the epoch each time it is
        iterated; ``set_epoch`` replays one).

    Raises:
        ConfigError: what cannot be kept (listed in the module docstring), or a batch size that
            does not divide by the world size.
    """
    if not isinstance(loader, DataLoader):
        raise ConfigError(
            f"setup_dataloader takes a torch DataLoader, got {type(loader).__name__}; for a dataset use "
            "session.build_loader(dataset, batch_size=...)"
        )
    if type(loader) is not DataLoader:
        raise ConfigError(
            f"{type(loader).__name__} is a DataLoader subclass: rebuilding it as a DataLoader would drop its own "
            "behaviour; build a plain DataLoader, or shard it yourself with a DistributedSampler"
        )
    kept = loader_settings(loader)
    batch_size, drop_last = _batching(loader)
    if isinstance(loader.dataset, IterableDataset):
        per_process = per_process_batch(batch_size, shard)
        dataset = StridedIterable(loader.dataset, shard) if shard.world_size > 1 else loader.dataset
        rebuilt = DataLoader(dataset, batch_size=per_process, drop_last=drop_last, **kept)
        return EpochLoader(
            rebuilt, None, seed=seed, rank=shard.rank, dataset=loader.dataset, world_size=shard.world_size
        )
    return build_epoch_loader(
        loader.dataset,
        global_batch=batch_size,
        shard=shard,
        shuffle=_shuffles(_sampler(loader)),
        seed=seed,
        drop_last=drop_last,
        **kept,
    )


def check_sharded(batches: object, shard: ShardSpec) -> None:
    """Refuse a map-style DataLoader that would load every sample on each of several ranks.

    Only torch's own non-distributed samplers are refused (their loaders are certainly not
    sharded); a custom sampler is trusted to shard. No-op for one process.

    Raises:
        ConfigError: naming ``session.setup_dataloader``.
    """
    if shard.world_size == 1 or not isinstance(batches, DataLoader) or isinstance(batches.dataset, IterableDataset):
        return
    sampler = _sampler(batches)
    if isinstance(sampler, DistributedSampler):
        if (sampler.num_replicas, sampler.rank) != (shard.world_size, shard.rank):
            raise ConfigError(
                f"the DataLoader's DistributedSampler is for rank {sampler.rank} of {sampler.num_replicas}, but this "
                f"process is rank {shard.rank} of {shard.world_size}; {_FIX}"
            )
        return
    if isinstance(sampler, _UNSHARDED):
        raise ConfigError(
            f"session.batches got a DataLoader with a {type(sampler).__name__}, which is not sharded: each of the "
            f"{shard.world_size} processes would train on every sample; {_FIX}, or use "
            "session.build_loader(dataset, batch_size=...)"
        )


def _sampler(loader: DataLoader) -> Sampler[Any] | Any:
    """The sampler that orders the samples: the batch sampler's own when it has one.

    A custom batch sampler without a ``.sampler`` orders the samples itself: ``loader.sampler`` is
    then the ``SequentialSampler`` torch fills in, which the user never chose, so it is not asked.
    """
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and not isinstance(batch_sampler, BatchSampler):
        return getattr(batch_sampler, "sampler", batch_sampler)
    return getattr(batch_sampler, "sampler", loader.sampler)


def _batching(loader: DataLoader) -> tuple[int, bool]:
    """The loader's (global) batch size and drop_last, from ``batch_size`` or a plain ``BatchSampler``."""
    if loader.batch_size is not None:
        return loader.batch_size, loader.drop_last
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        raise ConfigError(
            "the DataLoader has batch_size=None (its dataset yields whole batches), which cannot be split "
            "between processes; pass batch_size=GLOBAL_BATCH and let the dataset yield samples"
        )
    if type(batch_sampler) is not BatchSampler:
        raise ConfigError(
            f"the DataLoader's batch_sampler ({type(batch_sampler).__name__}) is custom: its batches cannot be "
            "rebuilt as the shared per-epoch permutation of every rank; pass batch_size= and shuffle= instead, or "
            "shard it yourself (a batch sampler over a DistributedSampler) and iterate with session.batches(...)"
        )
    return batch_sampler.batch_size, batch_sampler.drop_last


def _shuffles(sampler: object) -> bool:
    """Whether the loader shuffles; refuses samplers whose order cannot be kept."""
    if isinstance(sampler, DistributedSampler):
        raise ConfigError(
            "the DataLoader is already sharded by a DistributedSampler; iterate it with session.batches(loader) "
            "as it is (its batch_size is then the per-process batch), or give setup_dataloader an unsharded one"
        )
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:  # torch keeps num_samples private
            raise ConfigError(
                "the DataLoader's RandomSampler draws with replacement or its own num_samples, which cannot be "
                "kept as one shared permutation per epoch; use shuffle=True, or shard it yourself"
            )
        return True
    raise ConfigError(
        f"the DataLoader's sampler ({type(sampler).__name__}) is custom: its order cannot be kept as the shared "
        "per-epoch permutation of every rank; use shuffle=True/False, or shard it yourself (a sampler that "
        "yields this rank's indices) and iterate with session.batches(...)"
    )
