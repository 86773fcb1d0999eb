"""Sharded data: which samples each rank sees, per epoch, for training and for evaluation.

Policy (the same under every strategy, so one script gives the same global batches anywhere):

- **Training.** One seeded permutation of the dataset per epoch, identical on every rank
  (``torch.randperm`` seeded with ``seed + epoch``, the permutation torch's ``DistributedSampler``
  draws). :class:`EpochLoader` sets the epoch each time iteration starts, so shuffles differ per
  epoch without the classic forgotten ``sampler.set_epoch(epoch)``. Rank ``r`` of ``W`` takes
  positions ``r, r+W, r+2W, ...`` and batches them by ``global_batch // W``; so global batch ``k``
  is the same set of samples as the single-process batch ``k`` of the same permutation.
- **A dataset that does not divide** by the global batch (``drop_last=True``, the default): torch's
  ``DistributedSampler(drop_last=True)`` cuts the permutation to a multiple of ``W`` and the
  ``DataLoader(drop_last=True)`` drops each rank's short last batch. What remains is exactly the
  first ``(len(dataset) // global_batch) * global_batch`` positions: every rank takes the same
  number of full batches, as many steps as one device takes, and no sample is trained twice in an
  epoch; with shuffle, the left-out remainder is a different random set each epoch. A dataset
  smaller than one global batch is refused (its epochs would be empty). ``drop_last=False``
  instead pads the permutation with its first samples up to a multiple of ``W`` and keeps the
  short last batch: the same step count as one device, but under DDP the last global batch holds
  up to ``W - 1`` repeats of the epoch's first samples.
- **A user's own DataLoader** is rebuilt to this policy by
  :func:`multigpu.runtime.loaders.shard_dataloader` (``session.setup_dataloader``); iterable
  datasets are strided between ranks there.
- **Evaluation.** No shuffle, padded to a multiple of the world size; per-sample results are
  gathered by dataset index so the padding collapses (:func:`multigpu.runtime.collectives.gather_by_index`):
  exactly ``len(dataset)`` results.
- **Uneven inputs** (an iterable whose length differs per rank): :func:`even_batches` lets all
  ranks agree on the shortest, so no rank waits forever in an all-reduce that another never joins
  (``session.join`` lets every rank take all of its batches instead).
- **Resuming** mid-epoch: :class:`EpochLoader` is stateful and owns the seed its iterator draws
  (:mod:`multigpu.runtime.resumable`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from multigpu.errors import ConfigError
from multigpu.runtime.collectives import all_agree_min, reduce_value
from multigpu.runtime.resumable import check_same_data, epoch_seed, skip_first_batches
from multigpu.runtime.world import in_process_group

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


def build_train_sampler(
    dataset: Sized, shard: ShardSpec, *, global_batch: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
) -> DistributedSampler:
    """The training sampler of this shard: torch's ``DistributedSampler``, one seeded permutation per epoch.

    With ``drop_last`` torch's sampler cuts the permutation to a multiple of the world size and the
    loader (built with ``drop_last`` too) drops each rank's short last batch; together that keeps
    exactly the first ``(len(dataset) // global_batch) * global_batch`` positions, so global batch
    ``k`` under ``W`` ranks is batch ``k`` of one device (``tests/runtime/test_data.py`` checks
    it against one device over drawn sizes, world sizes, batches, seeds and epochs).

    Args:
        dataset: a map-style dataset (has ``__len__``).
        shard: this process's shard.
        global_batch: samples per step over all processes (checked to divide by the world size).
        shuffle: a new seeded permutation every epoch (``set_epoch``); dataset order otherwise.
        seed: the permutation seed (the same on every rank).
        drop_last: cut to whole global batches (with a ``drop_last`` loader); else pad to ``W``.

    Raises:
        ConfigError: ``global_batch`` does not divide by the world size (see :func:`per_process_batch`).

    Example:
        >>> data = list(range(10))
        >>> [list(build_train_sampler(data, ShardSpec(world_size=2, rank=r), global_batch=4, shuffle=False))
        ...  for r in (0, 1)]
        [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    """
    per_process_batch(global_batch, shard)  # validates, with a message that names a fix
    return DistributedSampler(
        dataset,  # type: ignore[arg-type]
        num_replicas=shard.world_size,
        rank=shard.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )


def build_eval_sampler(dataset: Sized, shard: ShardSpec) -> DistributedSampler:
    """The evaluation sampler of this shard: dataset order, padded to a multiple of the world size."""
    return DistributedSampler(dataset, num_replicas=shard.world_size, rank=shard.rank, shuffle=False)  # type: ignore[arg-type]


class EpochLoader(Generic[T]):
    """A DataLoader over this rank's shard that sets the sampler's epoch every time it is iterated.

    It is stateful: :meth:`state_dict` says which epoch is in flight and how many of its batches
    the loop has taken, and :meth:`load_state_dict` makes the next batch come from there (the
    iteration in flight moves; or else the next one starts there), skipping the taken batches
    without loading them (:mod:`multigpu.runtime.resumable`). It owns
    the seed its iterator draws: a generator of its own per epoch and rank (or the loader's own
    ``generator``, whose state it saves), so iterating never draws from torch's global generator
    and a resumed run's dropout masks follow the uninterrupted run's.

    Args:
        loader: the DataLoader, built on ``sampler``.
        sampler: its ``DistributedSampler`` (from :func:`build_train_sampler`): the object whose
            ``set_epoch`` is called; None for a loader without one (an iterable dataset).
        seed: the seed its own per-epoch generators derive from (with ``rank`` and the epoch).
        rank: this process's rank (the workers of each rank get seeds of their own).
        dataset: the dataset the caller built the loader over, which :attr:`dataset` answers
            (default: ``loader``'s, which may be this rank's stride of it).
        world_size: the processes that each load part of a global batch (default: the sampler's
            ``num_replicas``, or 1 without a sampler).

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.arange(8.0))
        >>> loader = build_epoch_loader(data, global_batch=4, shard=ShardSpec())
        >>> [len(list(loader)) for _ in range(2)], loader.epoch
        ([2, 2], 2)
    """

    def __init__(
        self,
        loader: DataLoader,
        sampler: DistributedSampler | None,
        *,
        seed: int = 0,
        rank: int = 0,
        dataset: Any = None,
        world_size: int | None = None,
    ) -> None:
        self.loader = loader
        self.sampler = sampler
        # the ranks that share each global batch: the sampler's, or the caller's for an iterable dataset
        self._world = world_size if world_size is not None else (sampler.num_replicas if sampler is not None else 1)
        self._dataset = loader.dataset if dataset is None else dataset
        self.epoch = 0  # the epoch the next iteration will use
        self.lookahead = 0  # batches taken from the iterator that the loop has not received (session.batches)
        self._seed, self._rank = seed, rank
        self._users_generator = loader.generator  # kept and saved; None: one of our own per epoch
        self._generator_state = None if loader.generator is None else loader.generator.get_state()
        self._skip = 0  # batches the next iteration skips (load_state_dict, skip_first_batches)
        self._in_flight: int | None = None  # the epoch being iterated
        self._taken = 0  # batches of that epoch taken (skipped ones included)
        self._iteration = 0  # iterations started; only the latest takes up a loaded position
        self._moved = False  # load_state_dict set a position that the iteration in flight has not taken up yet
        self.loads = 0  # positions loaded (session.batches notices one loaded inside its loop)
        # called as each iteration starts, before its first batch: a fault-tolerant replica group joins the
        # others there, so that a position it receives is this iteration's also in a loop over the loader itself
        self.before_iteration: Callable[[], None] | None = None

    @property
    def dataset(self) -> Any:
        """The whole dataset, as a DataLoader's ``dataset`` (``len(loader.dataset)`` counts every rank's samples)."""
        return self._dataset

    @property
    def batch_size(self) -> int | None:
        """The size of the batches this rank's iteration yields (the global batch divided by the world size)."""
        return self.loader.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration use ``epoch``'s permutation (e.g. after resuming)."""
        self.epoch = epoch

    def skip_first_batches(self, count: int) -> EpochLoader[T]:
        """Make the next iteration skip its first ``count`` batches (nothing loaded for them); returns self."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(
                f"skip_first_batches got count={count!r}; pass the number of batches to skip, an int >= 0"
            )
        self._skip = count
        return self

    @property
    def pending_skip(self) -> int:
        """The batches the next iteration skips (from :meth:`load_state_dict` or :meth:`skip_first_batches`)."""
        return self._skip

    def __iter__(self) -> Iterator[T]:
        if self.before_iteration is not None:
            self.before_iteration()
        self._iteration += 1
        return self._count(self._iteration, self._begin())

    def _begin(self) -> Iterator[T]:
        """The DataLoader's iterator from the position the next iteration takes up (``epoch``, ``pending_skip``)."""
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        generator = self._users_generator
        if generator is None:
            generator = torch.Generator().manual_seed(epoch_seed(self._seed, self._rank, self.epoch))
        else:
            self._generator_state = generator.get_state()  # what resuming this epoch restores
        skip, self._skip, self._moved = self._skip, 0, False
        self._in_flight, self._taken, self.lookahead = self.epoch, skip, 0
        self.epoch += 1
        self.loader.generator = generator  # the iterator's seed comes from it, not from torch's global generator
        return iter(skip_first_batches(self.loader, skip) if skip else self.loader)

    def _count(self, iteration: int, batches: Iterator[T]) -> Iterator[T]:
        while True:
            if self._moved and iteration == self._iteration:  # load_state_dict since the last batch: go on there
                batches = self._begin()
            batch = next(batches, _END)
            if batch is _END:
                break
            self._taken += 1
            yield batch
        if iteration == self._iteration:
            self._in_flight = None

    def __len__(self) -> int:
        return max(0, len(self.loader) - self._skip)

    def state_dict(self) -> dict[str, Any]:
        """Where the loop stands: ``{"epoch", "batch", "data"}`` (plus the loader's own generator's state, if it has one).

        ``batch`` counts the batches the loop has received of the epoch in flight (0 between epochs).
        ``data`` says what that position counts in (:meth:`data_identity`), so that a loader over other
        data, or with another global batch, refuses it instead of skipping the wrong samples.
        """
        taken, length = self._taken - self.lookahead, known_len(self.loader)
        in_flight = self._in_flight is not None and (length is None or taken < length)
        epoch, batch = (self._in_flight, taken) if in_flight else (self.epoch, self._skip)
        if not in_flight and length and self._skip >= length:  # a loaded epoch's end: the epoch after, as any end
            epoch, batch = self.epoch + 1, 0
        state: dict[str, Any] = {"epoch": epoch, "batch": batch, "data": self.data_identity()}
        if self._users_generator is not None:
            state["generator"] = self._generator_state if in_flight else self._users_generator.get_state()
        return state

    def data_identity(self) -> dict[str, Any]:
        """What a batch position means for this loader: the same values give the same batches in the same order.

        ``global_batch`` (samples per step over all processes; the world size may change),
        ``dataset_length`` (``None`` for a dataset without one), ``shuffle``, ``seed`` and ``drop_last``.
        """
        batch = self.loader.batch_size
        return {
            "global_batch": None if batch is None else batch * self._world,
            "dataset_length": _length(self._dataset),
            "shuffle": bool(self.sampler.shuffle) if self.sampler is not None else False,
            "seed": self._seed,
            "drop_last": bool(self.loader.drop_last),
        }

    def check_state_dict(self, state: Any) -> None:
        """Refuse a state :meth:`load_state_dict` cannot continue from exactly; changes nothing.

        A state from another loader setup (global batch, dataset length, shuffle, seed or drop_last
        differ) is refused naming each value saved and here. A state saved before these were recorded
        (no ``data`` entry) is taken as it is, but its batch must lie inside this loader's epoch.

        Raises:
            ConfigError: naming the entry, both values and the fix.
        """
        if not isinstance(state, Mapping):
            raise ConfigError(
                f"a loader state is a mapping with 'epoch' and 'batch', got {_short(state)}; pass what "
                "loader.state_dict() returned"
            )
        epoch, batch = state.get("epoch"), state.get("batch")
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in (epoch, batch)):
            raise ConfigError(
                f"a loader state needs ints 'epoch' and 'batch' >= 0, got {_short(dict(state))}; pass what "
                "loader.state_dict() returned"
            )
        saved = state.get("data")
        if saved is not None:
            check_same_data(saved, self.data_identity())
        length = known_len(self.loader)
        if length is not None and batch > length:  # type: ignore[operator]
            raise ConfigError(
                f"the loader state is at batch {batch} of epoch {epoch}, but an epoch of this loader has {length} "
                "batches: it was saved over other data or another batch size. Build the loader as the saved run "
                "did, or resume without loader= and start the next epoch (loader.set_epoch(epoch + 1))"
            )
        generator = state.get("generator")
        if self._users_generator is not None and generator is not None:
            try:
                torch.Generator(device=self._users_generator.device).set_state(generator)
            except Exception:  # whatever torch says, it is not a state of this generator
                raise ConfigError(
                    f"the loader state's 'generator' is {_short(generator)}, not a state of the loader's "
                    f"{self._users_generator.device} generator; pass what loader.state_dict() returned"
                ) from None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where :meth:`state_dict` stood: the next batch is that epoch's, from that batch.

        The iteration in flight, if any, takes it up at its next batch (a replica group healed inside
        ``session.step`` goes on with the others' batches); otherwise the next iteration starts there.
        The epoch's end (``batch`` equal to its length) ends the iteration in flight; the next is the
        epoch after.

        Raises:
            ConfigError: the state does not fit this loader (:meth:`check_state_dict`); nothing changed.
        """
        self.check_state_dict(state)
        self.epoch, self._skip, self._in_flight = state["epoch"], state["batch"], None
        self._moved, self.lookahead = True, 0
        self.loads += 1
        if self._users_generator is not None and state.get("generator") is not None:
            self._users_generator.set_state(state["generator"])


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset) if isinstance(dataset, Sized) else None
    except TypeError:  # a Sized type whose len() raises (an iterable dataset without one)
        return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
        drop_last: train whole global batches only: the same steps as one device, no sample twice
            (see :func:`build_train_sampler`). ``False`` keeps a short last batch, padded under DDP.
        **loader_kwargs: passed to DataLoader (``num_workers``, ``pin_memory``, ``collate_fn``...).

    Returns:
        An :class:`EpochLoader`.

    Raises:
        ConfigError: no ``len()``; a global batch that does not divide by the world size; or (with
            ``drop_last``) a dataset smaller than one global batch, whose epochs would be empty.
    """
    if not isinstance(dataset, Sized):
        raise ConfigError(
            f"dataset {type(dataset).__name__} has no len(); a sharded loader needs a map-style dataset, "
            "or iterate your own loader through even_batches()"
        )
    batch = per_process_batch(global_batch, shard)
    if drop_last and len(dataset) < global_batch:
        fits = len(dataset) - len(dataset) % shard.world_size  # the largest global batch it fills
        fix = f"batch_size={fits} or drop_last=False" if fits else "drop_last=False"
        raise ConfigError(
            f"the dataset has {len(dataset)} samples, fewer than one global batch of {global_batch}, "
            f"so every epoch would be empty; use {fix}"
        )
    sampler = build_train_sampler(
        dataset, shard, global_batch=global_batch, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=drop_last, **loader_kwargs)
    return EpochLoader(loader, sampler, seed=seed, rank=shard.rank)


def even_batches(batches: Iterable[T]) -> Iterator[T]:
    """Yield batches until *any* rank runs out, so ranks with more batches do not hang the others.

    With a known ``len()`` the ranks agree once on the shortest length (one all-reduce); without,
    they agree before every batch (one small all-reduce per step). Batches beyond the shortest
    rank's are skipped. Every rank must call it, and iterate it to the end (or break on all ranks),
    with the same kind of iterable (all with a working ``len()`` or all without).

    Example:
        >>> list(even_batches([1, 2, 3]))   # one process: unchanged
        [1, 2, 3]
    """
    if not in_process_group():
        yield from batches
        return
    length = known_len(batches)
    if length is not None:
        steps = all_agree_min(length, "the batch count (every rank has a len())")
        for step, batch in enumerate(batches):
            if step >= steps:
                return
            yield batch
        return
    iterator = iter(batches)
    while True:
        batch = next(iterator, _END)
        # note: one sync point per batch; every rank stops at the first rank's end
        if int(reduce_value(0 if batch is _END else 1, "min", what="the next-batch flag (no len())").item()) == 0:
            return
        yield batch  # type: ignore[misc]


_END: Any = object()


def known_len(batches: Iterable[Any]) -> int | None:
    """``len(batches)``, or None when it has no length.

    A DataLoader over an IterableDataset is ``Sized`` by type but its ``len()`` raises TypeError
    (unless the dataset defines ``__len__``), so ask rather than check the type.
    """
    if not isinstance(batches, Sized):
        return None
    try:
        return len(batches)
    except TypeError:
        return None


def shard_indices(dataset: Sized, shard: ShardSpec) -> torch.Tensor:
    """The dataset indices this rank evaluates, in order (see :func:`build_eval_sampler`)."""
    return torch.tensor(list(build_eval_sampler(dataset, shard)), dtype=torch.long)
