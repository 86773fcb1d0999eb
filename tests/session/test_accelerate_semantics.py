"""Accelerate's semantic tests (its ``test_ops.py``, ``test_sync.py``, ``test_distributed_data_loop.py``),
re-asked of the Session in one process and on a real one-rank gloo group: what test_toolkit.py left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from multigpu.errors import ConfigError
from multigpu.runtime import exchange
from multigpu.session import Session
from tests.launching import launch_workers
from tests.session.toolkit_worker import resume_and_train

BIG = 2**60 + 1  # not a float64: an integer reduced through float64 comes back as 2**60


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.n))


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_reducing_integer_tensors_keeps_every_digit(op: str) -> None:
    with Session(strategy="single") as session:
        reduced = session.reduce({"n": torch.tensor([BIG, 3, -BIG]), "bits": torch.tensor([True, False])}, op)
    assert reduced["n"].dtype == torch.int64 and reduced["n"].tolist() == [BIG, 3, -BIG]
    assert reduced["bits"].dtype == torch.bool and reduced["bits"].tolist() == [True, False]


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_reducing_integer_tensors_over_gloo_keeps_every_digit(one_rank_group: None, op: str) -> None:
    reduced = exchange.reduce([torch.tensor([BIG, -BIG]), torch.tensor([[7]], dtype=torch.int32)], op)
    assert reduced[0].tolist() == [BIG, -BIG] and reduced[1].dtype == torch.int32 and reduced[1].tolist() == [[7]]
    mean = exchange.reduce(torch.tensor([2, 3]), "mean")  # a mean of integers is float32, as documented
    assert mean.dtype == torch.float32 and mean.tolist() == [2.0, 3.0]


# -- real gloo ranks ------------------------------------------------------------------------------------

WORKER = Path(__file__).with_name("accelerate_worker.py")
CHECKS = [
    "join_accumulate_1",
    "join_accumulate_2",
    "join_accumulate_3",
    "join_accumulate_1_rank0_without_batches",
    "loader_attributes",
]


@pytest.fixture(scope="module", params=[2, 3])
def worker_output(request: pytest.FixtureRequest) -> str:
    return launch_workers(WORKER, nproc=request.param, timeout_s=120).stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize("check", CHECKS)
def test_accelerate_semantics_on_gloo_ranks(worker_output: str, check: str) -> None:
    assert f"ok {check}" in worker_output.splitlines(), worker_output[-2000:]


def test_a_session_loader_answers_what_a_dataloader_does() -> None:
    # Accelerate's prepared loader is a DataLoader: len(loader.dataset) and loader.batch_size work on it
    data = TensorDataset(torch.arange(10))
    stream = Stream(9)
    with Session(strategy="single") as session:
        for dataset in (data, stream):
            loader = session.setup_dataloader(DataLoader(dataset, batch_size=4))
            assert loader.dataset is dataset and loader.batch_size == 4
        built = session.build_loader(data, batch_size=2)
        assert built.dataset is data and built.batch_size == 2 and len(built) == 5


def _train_with_dropout(folder: Path, stop_at: int | None, **session_args: Any) -> dict[str, torch.Tensor] | None:
    """14 steps of a dropout MLP over a shuffled loader; save at ``stop_at`` and return, or resume and finish."""
    with Session(seed=0, **session_args) as session:
        model = session.setup_model(nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(3)
        data = TensorDataset(torch.randn(48, 5, generator=gen), torch.randint(0, 3, (48,), generator=gen))
        loader = session.setup_dataloader(DataLoader(data, batch_size=12, shuffle=True))
        return resume_and_train(session, model, optimizer, loader, folder, stop_at=stop_at)


@pytest.mark.parametrize(
    "session_args",
    [
        {"strategy": "single"},
        {"strategy": "dp", "devices": "cpu:2"},
        {"strategy": "dp", "devices": "cpu:3", "accumulate": 2},
    ],
    ids=["single", "dp-2", "dp-3-accumulate"],
)
def test_a_mid_epoch_resume_with_dropout_is_bit_exact(tmp_path: Path, session_args: dict[str, Any]) -> None:
    # Accelerate's save_state/load_state mid-epoch; with dp the CPU replicas' dropout draws must be in order
    whole = _train_with_dropout(tmp_path / "whole", None, **session_args)
    assert _train_with_dropout(tmp_path / "split", 6, **session_args) is None  # epoch 1, batch 2
    rest = _train_with_dropout(tmp_path / "split", None, **session_args)
    assert whole is not None and rest is not None
    assert all(torch.equal(whole[k], rest[k]) for k in whole)


@pytest.mark.parametrize("src", [1, -1, True])
def test_a_broadcast_from_a_rank_that_is_not_there_is_named(src: Any) -> None:
    # one process is a world of one: src=1 was an IndexError (broadcast_object) or silently rank 0's
    # value (broadcast), src=-1 the last rank's object, while a process group refused both
    with Session(strategy="single") as session:
        with pytest.raises(
            ConfigError, match=rf"src={src!r} is not a rank of this world of 1; use 0 <= src < world size"
        ):
            session.broadcast_object({"lr": 0.1}, src=src)
        with pytest.raises(ConfigError, match=rf"src={src!r} is not a rank"):
            session.broadcast([torch.ones(2)], src=src)


def test_a_broadcast_over_gloo_checks_src_for_objects_too(one_rank_group: None) -> None:
    with pytest.raises(ConfigError, match=r"src=-1 is not a rank of this world of 1"):
        exchange.broadcast_object("x", src=-1)
    assert exchange.broadcast_object("x", src=0) == "x"
