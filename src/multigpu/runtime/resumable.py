"""Resuming a loader mid-epoch: skip the batches already trained, and own the seed its iterator draws.

Two facts of torch's DataLoader decide how a run resumed in the middle of an epoch can continue
the uninterrupted one bit for bit:

- **Creating an iterator draws a seed** (the workers' base seed) from the loader's ``generator``,
  or from torch's global generator when it has none. A resumed run restores the global generator
  to the state of the save and then creates the iterator again: that draw shifts every later
  dropout mask. A loader with a generator of its own, seeded per epoch, draws the same seed in both
  runs and leaves the global stream alone (:func:`epoch_seed`).
- **Skipping must not load.** Skipping the first ``n`` batches by iterating them would load (and
  possibly augment with torch's global generator) samples the interrupted run already loaded;
  :class:`SkipBatches` skips at the level of the batch sampler's indices instead, so nothing is
  loaded. DataLoader workers seed their own generators per epoch, so augmentations drawn *inside
  workers* for the remaining batches differ from the uninterrupted run's (as in Accelerate).
- **A position counts batches of one setup.** Batch 17 of an epoch is other samples under another
  global batch, dataset, shuffle, seed or drop_last; :func:`check_same_data` refuses such a state.

Example:
    >>> loader = DataLoader(list(range(10)), batch_size=3)
    >>> [b.tolist() for b in skip_first_batches(loader, 2)]
    [[6, 7, 8], [9]]
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from multigpu.errors import ConfigError

# DataLoader arguments that travel to a rebuilt or skipping loader unchanged (those this torch has).
LOADER_SETTINGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "pin_memory_device",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "in_order",
)


def loader_settings(loader: DataLoader) -> dict[str, Any]:
    """``loader``'s settings of :data:`LOADER_SETTINGS`, ready to build another DataLoader with."""
    kept = {name: getattr(loader, name) for name in LOADER_SETTINGS if hasattr(loader, name)}
    if kept.get("num_workers", 0) == 0:
        kept.pop("prefetch_factor", None)  # torch refuses it without workers (older torch stored 2)
    return kept


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of a loader's own generator in ``epoch`` on ``rank``: independent per rank and epoch.

    Example:
        >>> epoch_seed(0, 0, 1) == epoch_seed(0, 0, 1) != epoch_seed(0, 1, 1)
        True
    """
    digest = hashlib.blake2b(f"multigpu-loader:{seed}:{rank}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


class SkipBatches:
    """A batch sampler that yields ``batch_sampler``'s batches from the ``skip``-th on (no sample loaded before)."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    @property
    def sampler(self) -> Any:
        """The sampler under the skipped batch sampler (so ``check_sharded`` judges the order, not this wrapper)."""
        return getattr(self.batch_sampler, "sampler", None)

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)  # type: ignore[arg-type]


def skip_first_batches(loader: DataLoader, count: int, **settings: Any) -> Iterable[Any]:
    """``loader``'s batches from the ``count``-th on, each time it is iterated.

    A map-style loader is rebuilt over a :class:`SkipBatches` batch sampler (the skipped samples are
    never loaded); an iterable dataset's first ``count`` batches are loaded and dropped.

    Args:
        loader: a DataLoader.
        count: how many batches to skip (an int >= 0).
        **settings: DataLoader settings that replace the loader's own (e.g. ``generator=``).

    Raises:
        ConfigError: ``count`` is not an int >= 0, or ``loader`` is not a DataLoader.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"skip_first_batches got count={count!r}; pass the number of batches to skip, an int >= 0")
    if not isinstance(loader, DataLoader):
        raise ConfigError(
            f"skip_first_batches takes a DataLoader (or a session's loader), got {type(loader).__name__}; "
            "for another iterable use itertools.islice(batches, count, None)"
        )
    if isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
        return _Dropped(loader, count)
    kept = {**loader_settings(loader), **settings}
    return DataLoader(loader.dataset, batch_sampler=SkipBatches(loader.batch_sampler, count), **kept)


class _Dropped:
    """An iterable loader whose first ``count`` batches are loaded and dropped."""

    def __init__(self, loader: DataLoader, count: int) -> None:
        self.loader = loader
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.loader), self.count, None)


# --- what a saved position counts in ---

_FIXES = {
    "global_batch": "batch_size={} (the global batch)",
    "dataset_length": "the same dataset, of {} samples",
    "shuffle": "shuffle={}",
    "seed": "seed={}",
    "drop_last": "drop_last={}",
}


def check_same_data(saved: Any, live: Mapping[str, Any]) -> None:
    """Refuse a loader state's ``data`` (what its batch position counts in) that differs from ``live``'s.

    Raises:
        ConfigError: naming each value saved and here, and the fix.
    """
    if not isinstance(saved, Mapping) or not set(saved) <= set(live):
        raise ConfigError(
            f"the loader state's 'data' is {_short(saved)}; expected a mapping of {sorted(live)}, as "
            "loader.state_dict() returns"
        )
    differ = [(name, saved[name], live[name]) for name in live if name in saved and not _same(saved[name], live[name])]
    if not differ:
        return
    saved_text = ", ".join(f"{name}={_short(was)}" for name, was, _ in differ)
    live_text = ", ".join(f"{name}={_short(now)}" for name, _, now in differ)
    fix = ", ".join(_FIXES[name].format(_short(was)) for name, was, _ in differ)
    raise ConfigError(
        f"the loader state was saved for {saved_text}, but this loader has {live_text}: its batch position "
        f"would count other batches (or none of the rest of the epoch). Build the loader as the saved run did "
        f"({fix}), or resume without loader= and start the next epoch yourself (loader.set_epoch(epoch + 1))"
    )


def _same(saved: Any, live: Any) -> bool:
    # Of one type first: a crafted value may be a tensor, whose == is not a bool.
    return type(saved) is type(live) and bool(saved == live)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
