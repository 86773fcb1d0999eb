"""The loop toolkit (gather, broadcast, reduce, pad, split, ordering, triggers, metrics, stateful loaders, join).

In-process: the data helpers' rules for world sizes 1-3 (every rank simulated in this process,
hypothesis-drawn sizes) against plain torch, and one process's answers and errors. Multi-process:
``toolkit_worker.py`` runs every collective check on real gloo ranks in one launch per world size.
"""

from __future__ import annotations

import collections
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from multigpu import Checkpointer
from multigpu.errors import CheckpointError, ConfigError
from multigpu.runtime.data import ShardSpec, build_epoch_loader
from multigpu.runtime.exchange import interleave, pad_across_processes, split_between_processes
from multigpu.runtime.loaders import check_sharded, shard_dataloader
from multigpu.runtime.resumable import skip_first_batches
from multigpu.session import Session, SessionConfig
from multigpu.session.coordination import MetricsPosition
from tests.launching import launch_workers, multigpu_launch

WORKER = Path(__file__).parent / "toolkit_worker.py"
CUDA_WORKER = Path(__file__).parent / "toolkit_cuda_worker.py"
_EXAMPLES = int(os.environ.get("MULTIGPU_FUZZ_EXAMPLES", "30"))
CHECKS = [
    "rank_streams",
    "collectives",
    "split_between_processes",
    "gather_for_metrics",
    "own_batch_sampler",
    "evaluate_padding",
    "process_order",
    "trigger",
    "join",
    "resume",
]

# -- every rank simulated in this process: the data helpers' rules against plain torch ------------


@settings(max_examples=_EXAMPLES, derandomize=True, deadline=None)
@given(world=st.integers(1, 3), n=st.integers(0, 30), padding=st.booleans())
def test_split_between_processes_gives_contiguous_shares_like_tensor_split(world: int, n: int, padding: bool) -> None:
    items = list(range(n))
    shares = [split_between_processes(items, world, r, apply_padding=padding) for r in range(world)]
    chunks = [c.tolist() for c in torch.tensor_split(torch.arange(n), world)]
    if padding:
        chunks = [c + items[-1:] * (len(chunks[0]) - len(c)) for c in chunks]
    assert shares == chunks
    tensors = [split_between_processes(torch.arange(n), world, r) for r in range(world)]
    assert torch.equal(torch.cat(tensors), torch.arange(n))
    # any other sequence comes back as a list of its items (a range's padded share raised TypeError, a deque's any)
    for sequence in (range(n), collections.deque(items)):
        assert [split_between_processes(sequence, world, r, apply_padding=padding) for r in range(world)] == chunks


@settings(max_examples=_EXAMPLES, derandomize=True, deadline=None)
@given(
    world=st.integers(1, 3),
    per_rank=st.integers(1, 4),
    n=st.integers(1, 40),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_gather_for_metrics_rules_give_the_one_device_rows(
    world: int, per_rank: int, n: int, shuffle: bool, drop_last: bool
) -> None:
    global_batch = world * per_rank
    if drop_last and n < global_batch:
        return  # refused (an empty epoch): tests/session/test_session.py
    one_device = DataLoader(
        TensorDataset(torch.arange(n)), batch_size=global_batch, shuffle=shuffle, drop_last=drop_last
    )
    loaders = [shard_dataloader(one_device, ShardSpec(world_size=world, rank=r), seed=9) for r in range(world)]
    position = MetricsPosition(loaders[0])
    got = []
    for batches in zip(*[iter(loader) for loader in loaders]):  # the ranks' batch k, as gathered
        position.next_batch()  # as session.batches does before each batch
        rows = position.arrange([b[0] for b in batches])
        items = position.arrange_items([b[0].tolist() for b in batches])  # per-sample objects (strings), alike
        got.append(rows[: position.keep(len(rows))])
        assert items[: position.keep(len(items))] == got[-1].tolist()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(9)) if shuffle else torch.arange(n)
    assert torch.equal(torch.cat(got), torch.cat(list(DataLoader(order, batch_size=global_batch, drop_last=drop_last))))


def test_interleave_puts_uneven_strided_pieces_in_stream_order() -> None:
    assert interleave([torch.tensor([0, 3, 6]), torch.tensor([1, 4]), torch.tensor([2, 5])]).tolist() == list(range(7))


@settings(max_examples=_EXAMPLES, derandomize=True, deadline=None)
@given(world=st.integers(1, 3), n=st.integers(1, 40), per_rank=st.integers(1, 3), taken=st.integers(0, 20))
def test_a_loader_state_resumes_the_same_batches(world: int, n: int, per_rank: int, taken: int) -> None:
    dataset = TensorDataset(torch.arange(n))
    for rank in range(world):
        shard = ShardSpec(world_size=world, rank=rank)
        build = lambda shard=shard: build_epoch_loader(  # noqa: E731
            dataset, global_batch=world * per_rank, shard=shard, drop_last=False, seed=2
        )
        whole = build()
        epochs = [[b[0].tolist() for b in whole] for _ in range(2)]
        epoch, batch = divmod(taken % (2 * len(epochs[0])), len(epochs[0]))
        stopped = build()
        for _ in range(epoch):
            list(stopped)
        batches = iter(stopped)
        for _ in range(batch):
            next(batches)
        resumed = build()
        resumed.load_state_dict(stopped.state_dict())
        assert [b[0].tolist() for b in resumed] == epochs[epoch][batch:]
        if epoch == 0:
            assert [b[0].tolist() for b in resumed] == epochs[1]  # the epoch after is whole


# what a batch position of the loader below counts in (saved with it, refused when the loader differs)
_DATA_OF_12 = {"global_batch": 3, "dataset_length": 12, "shuffle": False, "seed": 0, "drop_last": True}


def test_loader_state_counts_what_session_batches_handed_out(tmp_path: Path) -> None:
    with Session(strategy="single") as session:
        loader = session.build_loader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=False)
        for i, _ in enumerate(session.batches(loader)):  # it reads one batch ahead; the state must not count it
            if i == 1:
                assert loader.state_dict() == {"epoch": 0, "batch": 2, "data": _DATA_OF_12}
        assert loader.state_dict() == {"epoch": 1, "batch": 0, "data": _DATA_OF_12}
        skipped = session.skip_first_batches(loader, 3)
        assert [b[0].tolist() for b in session.batches(skipped)] == [[9, 10, 11]]
        padded = session.build_loader(TensorDataset(torch.arange(10)), batch_size=4, shuffle=False, drop_last=False)
        session.skip_first_batches(padded, 2)  # a resumed epoch: the metrics count the skipped samples
        assert [session.gather_for_metrics(b[0]).tolist() for b in session.batches(padded)] == [[8, 9]]
        assert len(list(loader)) == 4  # only the next iteration skipped


def test_skip_first_batches_of_plain_loaders_against_islice() -> None:
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=3)
    want = [b[0].tolist() for b in itertools.islice(loader, 2, None)]
    assert [b[0].tolist() for b in skip_first_batches(loader, 2)] == want

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(7))

    stream = DataLoader(Stream(), batch_size=2)
    assert [b.tolist() for b in skip_first_batches(stream, 2)] == [[4, 5], [6]]
    with pytest.raises(ConfigError, match=r"SequentialSampler, which is not sharded"):  # skipping hides nothing
        check_sharded(skip_first_batches(loader, 1), ShardSpec(world_size=2, rank=0))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"count=-1; pass the number of batches to skip"):
        skip_first_batches(loader, -1)
    with pytest.raises(ConfigError, match=r"takes a DataLoader .*got list; .*itertools.islice"):
        skip_first_batches([1, 2], 1)  # type: ignore[arg-type]


# -- one process: the answers and the errors ---------------------------------------------------------


def test_one_process_answers() -> None:
    with Session(strategy="single") as session:
        assert torch.equal(session.gather({"a": torch.tensor([1, 2])})["a"], torch.tensor([1, 2]))
        assert torch.equal(session.gather(torch.tensor(5)), torch.tensor([5]))
        assert session.gather_object("x") == ["x"]
        assert session.broadcast_object({"k": 1}) == {"k": 1}
        assert session.reduce(3) == 3.0 and isinstance(session.reduce(torch.tensor(2.0)), float)
        assert torch.equal(session.reduce({"v": torch.tensor([1.0, 2.0])})["v"], torch.tensor([1.0, 2.0]))
        assert torch.equal(session.pad_across_processes(torch.ones(2, 3), dim=1), torch.ones(2, 3))
        with session.split_between_processes([1, 2, 3]) as mine:
            assert mine == [1, 2, 3]
        with session.main_process_first(), session.main_process_first():  # nested: one block
            assert session.is_local_main_process
        with session.local_main_process_first(), pytest.raises(ConfigError, match=r"cannot nest"):
            with session.main_process_first():
                pass
        session.set_trigger()
        assert session.check_trigger() and not session.check_trigger()
        model = session.setup_model(nn.Linear(2, 1))
        with session.join(model):  # one process: nothing to shadow
            assert len(list(session.batches([torch.ones(1)], even_batches=False))) == 1
        assert torch.equal(session.gather_for_metrics(torch.arange(3)), torch.arange(3))


def test_bad_input_names_the_value_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"takes a list, tuple, tensor or a dict of them, got int"):
        split_between_processes(3, 2, 0)
    with pytest.raises(ConfigError, match=r"dict whose values differ in length \(\{'a': 2, 'b': 1\}\)"):
        split_between_processes({"a": [1, 2], "b": [1]}, 2, 0)
    with pytest.raises(ConfigError, match=r"dim=2 for a tensor of shape \(2, 2\); use a dim in \[-2, 1\]"):
        pad_across_processes(torch.ones(2, 2), dim=2)
    with pytest.raises(ConfigError, match=r"seed_per_rank='yes' must be True or False"):
        SessionConfig(seed_per_rank="yes")  # type: ignore[arg-type]
    loader = build_epoch_loader(TensorDataset(torch.arange(4)), global_batch=2, shard=ShardSpec())
    with pytest.raises(ConfigError, match=r"needs ints 'epoch' and 'batch' >= 0, got \{'epoch': -1\}"):
        loader.load_state_dict({"epoch": -1})


def test_gather_for_metrics_twice_per_batch_keeps_every_sample_of_both() -> None:
    """Predictions and labels gathered in two calls: the batch counts once (Accelerate users do this)."""
    data = TensorDataset(torch.arange(10.0), torch.arange(10))
    with Session(strategy="single") as session:
        loader = session.setup_dataloader(DataLoader(data, batch_size=4, shuffle=False))
        xs, ys = [], []
        for x, y in session.batches(loader):
            xs.append(session.gather_for_metrics(x))
            ys.append(session.gather_for_metrics(y))
    assert torch.equal(torch.cat(xs), torch.arange(10.0)) and torch.equal(torch.cat(ys), torch.arange(10))


def test_checkpointer_loader_state_errors(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    loader = build_epoch_loader(TensorDataset(torch.arange(4)), global_batch=2, shard=ShardSpec())
    checkpointer = Checkpointer(folder=tmp_path)
    with pytest.raises(ConfigError, match=r"data_position has the key 'loader', which loader= fills"):
        checkpointer.save(step=1, model=model, data_position={"loader": 1}, loader=loader)
    with pytest.raises(
        ConfigError, match=r"loader= got a DataLoader without state_dict\(\); .*session.setup_dataloader"
    ):
        checkpointer.save(step=1, model=model, loader=DataLoader(TensorDataset(torch.arange(4))))  # type: ignore[arg-type]
    checkpointer.save(step=1, model=model)
    with torch.no_grad():
        model.weight.add_(1.0)  # differs from the saved weights: a refused resume must leave it so
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"holds no loader state \(it was saved without loader=\); nothing"):
        checkpointer.resume(model=model, loader=loader)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # all or nothing


# -- real gloo ranks ------------------------------------------------------------------------------------


@pytest.fixture(
    scope="module",
    params=[
        2,
        pytest.param(
            3, marks=pytest.mark.skipif(os.environ.get("MULTIGPU_LONG") != "1", reason="3 ranks: set MULTIGPU_LONG=1")
        ),
    ],
)
def worker_output(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp(f"toolkit{request.param}")
    return launch_workers(WORKER, str(out), "--examples", "6", nproc=request.param, timeout_s=240).stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize("check", CHECKS)
def test_toolkit_on_gloo_ranks(worker_output: str, check: str) -> None:
    assert f"ok {check}" in worker_output.splitlines(), worker_output[-2000:]


@pytest.mark.cuda
@pytest.mark.multiprocess
def test_toolkit_on_nccl(tmp_path: Path) -> None:
    done = multigpu_launch("--strategy", "ddp", str(CUDA_WORKER), str(tmp_path), timeout_s=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"ok cuda_collectives", "ok cuda_resume"} <= set(done.stdout.splitlines()), done.stdout[-2000:]


def test_a_users_generator_is_saved_at_the_start_of_the_epoch_in_flight() -> None:
    generator = torch.Generator().manual_seed(5)
    own = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True, generator=generator)
    loader = shard_dataloader(own, ShardSpec(), seed=0)
    at_start = generator.get_state()
    batches = iter(loader)
    next(batches)  # the iterator drew its seed from the user's generator
    assert not torch.equal(generator.get_state(), at_start)
    state = loader.state_dict()
    assert state["batch"] == 1 and torch.equal(state["generator"], at_start)
    loader.load_state_dict(state)
    assert torch.equal(generator.get_state(), at_start)  # the resumed epoch draws the same seed again
