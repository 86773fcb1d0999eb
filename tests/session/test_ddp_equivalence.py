"""Two real gloo processes under the ddp strategy against plain PyTorch on one device.

One launch runs every scenario (tests/session/ddp_worker.py, started by the ``ranks`` fixture in
tests/session/conftest.py); each test checks one of them.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from tests.session.oracle import plain_train, regression_data

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("ddp_worker.py")


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_two_processes_end_with_the_weights_of_one_device(ranks: list[dict[str, Any]]) -> None:
    assert [r["world_size"] for r in ranks] == [2, 2]
    want = plain_train(regression_data(32), global_batch=8).state_dict()
    for rank in ranks:
        assert rank["fp32"]["steps"] == 8  # 2 epochs x 32 samples / global batch 8
        _assert_same_weights(rank["fp32"]["state_dict"], want)


def test_an_own_dataloader_set_up_by_the_session_trains_like_one_device(ranks: list[dict[str, Any]]) -> None:
    # before setup_dataloader, a one-device DataLoader under ddp trained every sample on every rank
    want = plain_train(regression_data(32), global_batch=8).state_dict()
    for rank in ranks:
        assert rank["own_loader"]["steps"] == 8
        _assert_same_weights(rank["own_loader"]["state_dict"], want)


def test_an_unsharded_dataloader_is_refused_naming_setup_dataloader(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert "RandomSampler, which is not sharded: each of the 2 processes" in rank["unsharded_refused"]
        assert "session.setup_dataloader(loader)" in rank["unsharded_refused"]


def test_accumulation_matches_one_device_on_the_combined_batch(ranks: list[dict[str, Any]]) -> None:
    want = plain_train(regression_data(32), global_batch=8, accumulate=2).state_dict()
    for rank in ranks:
        assert rank["accumulate"]["steps"] == 4
        _assert_same_weights(rank["accumulate"]["state_dict"], want)


def test_a_short_last_window_syncs_and_steps_like_one_device(ranks: list[dict[str, Any]]) -> None:
    want = plain_train(regression_data(32), global_batch=8, accumulate=3).state_dict()
    for rank in ranks:
        assert rank["accumulate_short"]["steps"] == 4  # 2 epochs x (a window of 3 batches + one of 1)
        _assert_same_weights(rank["accumulate_short"]["state_dict"], want)


def test_closing_a_session_keeps_a_group_it_did_not_create(ranks: list[dict[str, Any]]) -> None:
    assert [r["group_kept"] for r in ranks] == [True, True]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(ranks: list[dict[str, Any]], precision: str) -> None:
    losses = ranks[0][precision]["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0]
    _assert_same_weights(ranks[1][precision]["state_dict"], ranks[0][precision]["state_dict"])


def test_uneven_inputs_stop_together_at_the_shortest_rank(ranks: list[dict[str, Any]]) -> None:
    # rank 0 has 3 batches, rank 1 has 5; both stop after 3 instead of rank 1 hanging in all-reduce
    # (stream_loader: a DataLoader over an IterableDataset, whose len() raises TypeError)
    for rank in ranks:
        assert rank["uneven"] == {"sized": 3, "unsized": 3, "stream_loader": 3}


def test_an_iterable_dataset_is_strided_into_the_one_device_global_batches(ranks: list[dict[str, Any]]) -> None:
    # one device: [0..3], [4..7] (drop_last drops [8, 9]); rank r takes items r, r+2, ...
    assert ranks[0]["strided_stream"] == [[0, 2], [4, 6]]
    assert ranks[1]["strided_stream"] == [[1, 3], [5, 7]]


def test_sampler_shuffles_per_epoch_and_ranks_share_one_permutation(ranks: list[dict[str, Any]]) -> None:
    dataset = TensorDataset(torch.arange(10))
    for epoch in (0, 1):
        shards = [r["epochs"][f"epoch{epoch}"] for r in ranks]
        assert not set(shards[0]) & set(shards[1])
        interleaved = [i for pair in zip(*shards) for i in pair]
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)  # type: ignore[arg-type]
        sampler.set_epoch(epoch)
        assert interleaved == list(sampler)
    assert ranks[0]["epochs"]["epoch0"] != ranks[0]["epochs"]["epoch1"]


def test_a_dataset_that_does_not_divide_gives_the_one_device_steps_and_no_repeats(ranks: list[dict[str, Any]]) -> None:
    # 23 samples, global batch 8: one device takes 2 full batches of its permutation; so must ddp
    sampler: DistributedSampler[int] = DistributedSampler(
        TensorDataset(torch.arange(23)), num_replicas=1, rank=0, shuffle=True, seed=0
    )  # type: ignore[arg-type]
    order = list(sampler)
    steps = [sorted(a + b) for a, b in zip(ranks[0]["epochs"]["ragged"], ranks[1]["epochs"]["ragged"], strict=True)]
    assert steps == [sorted(order[0:8]), sorted(order[8:16])]


def test_evaluation_gathers_each_sample_exactly_once(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:  # 11 samples on 2 ranks: one is padded and evaluated twice, returned once
        torch.testing.assert_close(rank["evaluate"], torch.arange(11.0) * 2)


def test_metrics_reduce_over_processes(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:  # rank r contributes r + 1
        assert rank["reduce"] == {"mean": 1.5, "sum": 3.0, "max": 2.0, "min": 1.0}


def test_each_process_knows_its_rank_and_local_rank(ranks: list[dict[str, Any]]) -> None:
    assert [r["ranks"] for r in ranks] == [(0, 0, 0), (1, 1, 1)]


def test_every_rank_logs_but_only_the_main_process_writes(ranks: list[dict[str, Any]], ddp_out: Path) -> None:
    with (ddp_out / "run" / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [(r["step"], r["metric"], float(r["value"])) for r in rows] == [
        (str(step), name, value) for step in range(3) for name, value in (("loss", float(step)), ("rank", 0.0))
    ]
