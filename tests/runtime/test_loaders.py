"""A user's own DataLoader, sharded: every rank's rebuilt loader simulated in this process, against one device."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
    get_worker_info,
)

from multigpu.errors import ConfigError
from multigpu.runtime.data import ShardSpec
from multigpu.runtime.loaders import StridedIterable, check_sharded, shard_dataloader

_EXAMPLES = int(os.environ.get("MULTIGPU_FUZZ_EXAMPLES", "30"))


class Stream(IterableDataset):  # type: ignore[type-arg]
    """``0 .. count-1``; with DataLoader workers, worker ``w`` of ``k`` yields every ``k``-th item from ``w``."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(torch.tensor(i) for i in range(start, self.count, step))


def _ids(batch: Any) -> list[int]:
    return (batch[0] if isinstance(batch, (list, tuple)) else batch).tolist()  # type: ignore[no-any-return]


def _global_steps(loader: DataLoader, world: int, epoch: int = 0) -> list[list[int]]:
    """Step k's global batch under ``world`` ranks: every rank's rebuilt loader, up to the first rank's end."""
    per_rank = []
    for rank in range(world):
        sharded = shard_dataloader(loader, ShardSpec(world_size=world, rank=rank), seed=5)
        sharded.set_epoch(epoch)
        per_rank.append([_ids(b) for b in sharded])
    steps = min(len(batches) for batches in per_rank)  # the Session's even_batches stops there
    return [sorted(i for batches in per_rank for i in batches[k]) for k in range(steps)]


@settings(max_examples=_EXAMPLES, derandomize=True, deadline=None)
@given(
    world=st.integers(1, 5),
    per_rank=st.integers(1, 6),
    n=st.integers(1, 120),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    epoch=st.integers(0, 9),
)
def test_a_map_style_loader_gives_the_one_device_global_batches(
    world: int, per_rank: int, n: int, shuffle: bool, drop_last: bool, epoch: int
) -> None:
    global_batch = world * per_rank
    if drop_last and n < global_batch:
        return  # refused: every epoch would be empty (tests/session/test_session.py)
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=global_batch, shuffle=shuffle, drop_last=drop_last)
    # one device: the shared permutation of seed + epoch (or dataset order), batched in turn
    order = (
        torch.randperm(n, generator=torch.Generator().manual_seed(5 + epoch)).tolist() if shuffle else list(range(n))
    )
    want = [sorted(order[k : k + global_batch]) for k in range(0, n, global_batch)]
    want = [b for b in want if len(b) == global_batch] if drop_last else want
    steps = _global_steps(loader, world, epoch)
    if drop_last or n % world == 0:
        assert steps == want
    else:  # the documented padding of drop_last=False: the last batch repeats the first samples
        assert steps[:-1] == want[:-1] and set(steps[-1]) == set(want[-1]) | set(order[: -n % world])


@settings(max_examples=_EXAMPLES, derandomize=True, deadline=None)
@given(world=st.integers(1, 5), per_rank=st.integers(1, 6), n=st.integers(0, 120), drop_last=st.booleans())
def test_an_iterable_dataset_is_strided_into_the_one_device_global_batches(
    world: int, per_rank: int, n: int, drop_last: bool
) -> None:
    global_batch = world * per_rank
    want = [_ids(b) for b in DataLoader(Stream(n), batch_size=global_batch, drop_last=drop_last)]
    steps = _global_steps(DataLoader(Stream(n), batch_size=global_batch, drop_last=drop_last), world)
    # drop_last=False: a last batch of fewer than `world` items is skipped (some rank has none of it)
    lost = not drop_last and 0 < n % global_batch < world
    assert steps == [sorted(b) for b in want][: len(want) - lost]


@pytest.mark.multiprocess
def test_workers_each_stride_their_own_part_of_the_stream() -> None:
    loader = DataLoader(Stream(16), batch_size=4, num_workers=2)
    want = sorted(sorted(_ids(b)) for b in loader)  # worker 0: evens, worker 1: odds, batches alternate
    assert sorted(_global_steps(loader, 2)) == want


@pytest.mark.multiprocess
def test_the_loader_settings_are_kept() -> None:
    def collate(samples: list[tuple[torch.Tensor]]) -> torch.Tensor:
        return torch.stack([s[0] for s in samples]) * 10

    def init_worker(worker_id: int) -> None:
        torch.manual_seed(worker_id)

    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(
        TensorDataset(torch.arange(12)),
        batch_size=6,
        shuffle=True,
        num_workers=1,
        collate_fn=collate,
        pin_memory=False,
        timeout=30,
        worker_init_fn=init_worker,
        generator=generator,
        prefetch_factor=3,
        persistent_workers=True,
        drop_last=True,
    )
    sharded = shard_dataloader(loader, ShardSpec(world_size=2, rank=1), seed=0)
    rebuilt = sharded.loader
    assert rebuilt.batch_size == 3 and rebuilt.drop_last is True
    assert rebuilt.collate_fn is collate and rebuilt.worker_init_fn is init_worker and rebuilt.generator is generator
    assert (rebuilt.num_workers, rebuilt.timeout, rebuilt.prefetch_factor, rebuilt.persistent_workers) == (
        1,
        30,
        3,
        True,
    )
    assert isinstance(rebuilt.sampler, DistributedSampler) and rebuilt.sampler.shuffle
    batches = list(sharded)
    assert len(batches) == 2 and all(int(b.remainder(10).abs().sum()) == 0 for b in batches)  # collate ran


def test_a_plain_batch_sampler_is_read_as_the_batch_size() -> None:
    dataset = TensorDataset(torch.arange(10))
    loader = DataLoader(dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), 4, drop_last=True))
    assert _global_steps(loader, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


class _Subclass(DataLoader):  # type: ignore[type-arg]
    pass


class _Pairs(BatchSampler):
    pass


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (lambda d: _Subclass(d, batch_size=2), r"_Subclass is a DataLoader subclass"),
        (lambda d: DataLoader(d, batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8)), r"sampler \(Weighted"),
        (lambda d: DataLoader(d, batch_sampler=_Pairs(SequentialSampler(d), 2, False)), r"batch_sampler \(_Pairs\)"),
        (lambda d: DataLoader(d, batch_size=2, sampler=RandomSampler(d, replacement=True)), r"with replacement"),
        (lambda d: DataLoader(d, batch_size=None), r"batch_size=None"),
        (lambda d: DataLoader(d, batch_size=2, sampler=DistributedSampler(d, 2, 0)), r"already sharded"),
        (lambda d: list(d), r"takes a torch DataLoader, got list"),
    ],
)
def test_what_cannot_be_kept_is_refused_with_what_to_do(build: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        shard_dataloader(build(TensorDataset(torch.arange(8))), ShardSpec(world_size=2, rank=0), seed=0)


def test_a_global_batch_that_does_not_divide_names_one_that_does() -> None:
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=5)
    with pytest.raises(ConfigError, match=r"batch_size=5 \(the global batch\).*use batch_size=4"):
        shard_dataloader(loader, ShardSpec(world_size=2, rank=0), seed=0)


def test_an_unsharded_loader_is_refused_under_several_processes_only() -> None:
    dataset = TensorDataset(torch.arange(8))
    two = ShardSpec(world_size=2, rank=1)
    for loader in (DataLoader(dataset, batch_size=2, shuffle=True), DataLoader(dataset, batch_size=2)):
        with pytest.raises(ConfigError, match=r"not sharded: each of the 2 processes.*session\.setup_dataloader"):
            check_sharded(loader, two)
        check_sharded(loader, ShardSpec())  # one process: nothing to shard
    check_sharded(DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, 2, 1)), two)
    with pytest.raises(ConfigError, match=r"DistributedSampler is for rank 0 of 4, but this process is rank 1 of 2"):
        check_sharded(DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, 4, 0)), two)
    check_sharded(DataLoader(Stream(4), batch_size=2), two)  # an iterable may shard itself: documented
    check_sharded(shard_dataloader(DataLoader(dataset, batch_size=2), two, seed=0), two)
    check_sharded([torch.zeros(2)], two)


def test_strided_iterable_takes_every_world_size_th_item() -> None:
    assert [list(StridedIterable(range(7), ShardSpec(world_size=3, rank=r))) for r in range(3)] == [
        [0, 3, 6],
        [1, 4],
        [2, 5],
    ]


class EveryOtherBatch:
    """A user's own batch sampler that shards: rank ``rank`` of 2 takes batches of its parity (no ``.sampler``)."""

    def __init__(self, n: int, rank: int) -> None:
        self.batches = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)][rank::2]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_a_users_own_sharded_batch_sampler_is_trusted_by_session_batches() -> None:
    # torch fills loader.sampler with a SequentialSampler the user never chose: it must not count
    dataset = TensorDataset(torch.arange(8))
    loader = DataLoader(dataset, batch_sampler=EveryOtherBatch(8, rank=1))
    assert type(loader.sampler) is SequentialSampler
    check_sharded(loader, ShardSpec(world_size=2, rank=1))
    assert [_ids(b) for b in loader] == [[2, 3], [6, 7]]
    # torch's own BatchSampler over an unsharded sampler is still refused
    plain = DataLoader(dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), 2, False))
    with pytest.raises(ConfigError, match=r"SequentialSampler, which is not sharded"):
        check_sharded(plain, ShardSpec(world_size=2, rank=1))
