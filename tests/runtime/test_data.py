"""The sharding policy, checked without processes: every rank's loader is built from its ShardSpec."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import IterableDataset, TensorDataset

from multigpu.errors import ConfigError
from multigpu.runtime.data import ShardSpec, build_epoch_loader, even_batches, per_process_batch, shard_indices


def _batches(
    n: int,
    global_batch: int,
    world: int,
    epoch: int = 0,
    *,
    shuffle: bool = True,
    drop_last: bool = True,
    seed: int = 0,
) -> list[list[list[int]]]:
    """Per rank, the list of index batches of one epoch (ranks simulated in this process)."""
    out = []
    for rank in range(world):
        loader = build_epoch_loader(
            TensorDataset(torch.arange(n)),
            global_batch=global_batch,
            shard=ShardSpec(world_size=world, rank=rank),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        loader.set_epoch(epoch)
        out.append([b.tolist() for (b,) in loader])
    return out


def _global_steps(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """Step k's global batch: the union of every rank's batch k (ranks must agree on the count)."""
    assert len({len(batches) for batches in per_rank}) == 1, [len(batches) for batches in per_rank]
    return [sorted(i for batches in per_rank for i in batches[k]) for k in range(len(per_rank[0]))]


def _one_device_order(n: int, epoch: int, *, shuffle: bool, seed: int = 0) -> list[int]:
    """The oracle's sample order: one seeded permutation per epoch (``randperm(seed + epoch)``), or dataset order."""
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _one_device_batches(
    n: int, global_batch: int, epoch: int, *, shuffle: bool, drop_last: bool, seed: int = 0
) -> list[list[int]]:
    """The oracle's batches (sorted): one device, that order, batched in turn."""
    order = _one_device_order(n, epoch, shuffle=shuffle, seed=seed)
    batches = [sorted(order[k : k + global_batch]) for k in range(0, n, global_batch)]
    return [b for b in batches if len(b) == global_batch] if drop_last else batches


@pytest.mark.parametrize("n", [32, 37])
def test_global_batches_are_the_same_sets_on_one_or_two_ranks(n: int) -> None:
    (single,) = _batches(n, 8, 1, epoch=3)
    two = _batches(n, 8, 2, epoch=3)
    assert len(two[0]) == len(two[1]) == len(single) == n // 8  # incomplete global batch dropped
    for k, batch in enumerate(single):
        assert sorted(two[0][k] + two[1][k]) == sorted(batch)


# (37, 8, 4) and (1797, 36, 4) are a reviewer's repro: padding to a multiple of 4 filled one more
# per-rank batch, so ddp took 5 (50) steps where one device took 4 (49), re-training early samples.
@pytest.mark.parametrize(("n", "global_batch", "world"), [(37, 8, 4), (1797, 36, 4), (23, 8, 2), (32, 8, 4)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_ddp_takes_exactly_the_one_device_batches_and_no_sample_twice(
    n: int, global_batch: int, world: int, shuffle: bool
) -> None:
    for epoch in (0, 1):
        steps = _global_steps(_batches(n, global_batch, world, epoch, shuffle=shuffle))
        assert len(steps) == n // global_batch
        assert steps == _one_device_batches(n, global_batch, epoch, shuffle=shuffle, drop_last=True)
        trained = [i for batch in steps for i in batch]
        assert len(trained) == len(set(trained)) == n // global_batch * global_batch


_EXAMPLES = int(os.environ.get("MULTIGPU_FUZZ_EXAMPLES", "40"))


@settings(max_examples=_EXAMPLES, derandomize=True, deadline=None)
@given(
    world=st.integers(1, 8),
    per_rank=st.integers(1, 9),
    n=st.integers(1, 300),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 50),
)
def test_global_batches_equal_the_one_device_batches_for_drawn_configurations(
    world: int, per_rank: int, n: int, shuffle: bool, drop_last: bool, seed: int, epoch: int
) -> None:
    """torch's DistributedSampler + DataLoader(drop_last) give one device's global batches; drop_last=False pads."""
    global_batch = world * per_rank
    if drop_last and n < global_batch:
        return  # refused with a ConfigError (test_a_dataset_smaller_than_one_global_batch_names_a_batch_that_fits)
    steps = _global_steps(_batches(n, global_batch, world, epoch, shuffle=shuffle, drop_last=drop_last, seed=seed))
    want = _one_device_batches(n, global_batch, epoch, shuffle=shuffle, drop_last=drop_last, seed=seed)
    assert len(steps) == len(want)
    if drop_last:
        assert steps == want
        return
    assert steps[:-1] == want[:-1]
    order = _one_device_order(n, epoch, shuffle=shuffle, seed=seed)
    padding = (order * world)[: -n % world]  # the first samples again (cyclically when n < world)
    assert steps[-1] == sorted(want[-1] + padding)  # the documented repeats of the epoch's first samples


@pytest.mark.parametrize(("n", "global_batch", "world"), [(37, 8, 4), (1797, 36, 4)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_drop_last_false_keeps_a_short_last_batch_padded_with_the_first_samples(
    n: int, global_batch: int, world: int, shuffle: bool
) -> None:
    steps = _global_steps(_batches(n, global_batch, world, shuffle=shuffle, drop_last=False))
    want = _one_device_batches(n, global_batch, 0, shuffle=shuffle, drop_last=False)
    assert len(steps) == len(want) == -(-n // global_batch)  # the same step count as one device
    assert steps[:-1] == want[:-1]
    # the documented duplicates: the last global batch is padded with the epoch's first samples
    padding = _one_device_order(n, 0, shuffle=shuffle)[: -n % world]
    assert steps[-1] == sorted(want[-1] + padding)
    assert {i for batch in steps for i in batch} == set(range(n))


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
    with pytest.raises(
        ConfigError,
        match=r"batch_size=63 \(the global batch\) must be a positive multiple of the world size 2; use batch_size=62",
    ):
        per_process_batch(63, ShardSpec(world_size=2, rank=1))


def test_bad_shard_and_iterable_dataset_are_errors() -> None:
    with pytest.raises(ConfigError, match="rank=2 of world_size=2"):
        ShardSpec(world_size=2, rank=2)

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(3)

    with pytest.raises(ConfigError, match=r"has no len\(\).*even_batches"):
        build_epoch_loader(Stream(), global_batch=2, shard=ShardSpec())


def test_even_batches_outside_a_group_passes_everything_through() -> None:
    assert list(even_batches(iter([1, 2, 3]))) == [1, 2, 3]
