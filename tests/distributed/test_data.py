"""The sharding policy, checked without processes: every rank's loader is built from its ShardSpec."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from multigpu.distributed.data import ShardSpec, build_epoch_loader, even_batches, per_process_batch, shard_indices
from multigpu.errors import ConfigError


def _batches(n: int, global_batch: int, world: int, epoch: int = 0) -> list[list[list[int]]]:
    """Per rank, the list of index batches of one epoch."""
    out = []
    for rank in range(world):
        loader = build_epoch_loader(TensorDataset(torch.arange(n)), global_batch=global_batch, shard=ShardSpec(world_size=world, rank=rank))
        loader.set_epoch(epoch)
        out.append([b.tolist() for (b,) in loader])
    return out


@pytest.mark.parametrize("n", [32, 37])
def test_global_batches_are_the_same_sets_on_one_or_two_ranks(n: int) -> None:
    (single,) = _batches(n, 8, 1, epoch=3)
    two = _batches(n, 8, 2, epoch=3)
    assert len(two[0]) == len(two[1]) == len(single) == n // 8  # incomplete global batch dropped
    for k, batch in enumerate(single):
        assert sorted(two[0][k] + two[1][k]) == sorted(batch)


def test_each_epoch_has_a_new_shuffle_and_set_epoch_replays_one() -> None:
    loader = build_epoch_loader(TensorDataset(torch.arange(16)), global_batch=16, shard=ShardSpec())
    first, second = [next(iter(loader))[0].tolist() for _ in range(2)]
    assert first != second and sorted(first) == sorted(second) == list(range(16))
    assert loader.epoch == 2
    loader.set_epoch(0)
    assert next(iter(loader))[0].tolist() == first


def test_eval_shards_cover_the_dataset_with_padding_only_to_even_out() -> None:
    shards = [shard_indices(list(range(5)), ShardSpec(world_size=2, rank=r)).tolist() for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 3
    assert set(shards[0]) | set(shards[1]) == set(range(5))


def test_per_process_batch_names_a_global_batch_that_divides() -> None:
    assert per_process_batch(64, ShardSpec(world_size=4, rank=0)) == 16
    with pytest.raises(ConfigError, match=r"batch_size=63 \(the global batch\) must be a positive multiple of the world size 2; use batch_size=62"):
        per_process_batch(63, ShardSpec(world_size=2, rank=1))


def test_bad_shard_and_iterable_dataset_are_errors() -> None:
    with pytest.raises(ConfigError, match="rank=2 of world_size=2"):
        ShardSpec(world_size=2, rank=2)

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(3)

    with pytest.raises(ConfigError, match="has no len\\(\\).*even_batches"):
        build_epoch_loader(Stream(), global_batch=2, shard=ShardSpec())


def test_even_batches_outside_a_group_passes_everything_through() -> None:
    assert list(even_batches(iter([1, 2, 3]))) == [1, 2, 3]
