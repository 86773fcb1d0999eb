"""``session.backward(loss_sum, num_items=n)`` against one device over the global batch (float64, 1e-10).

Hypothesis draws ragged item counts (zero-item micro-batches on some ranks included), world sizes
1-3 and accumulate 1-4 (tests/session/item_cases.py). In one process, ``single`` and ``dp`` train on
every rank's items at once; two launches (2 and 3 real gloo ranks) run their drawn cases under ddp
and fsdp (tests/session/items_worker.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from multigpu.errors import ConfigError
from multigpu.session import Session
from tests.launching import launch_workers
from tests.session.item_cases import (
    ItemCase,
    assert_matches_oracle,
    build_model,
    draw_cases,
    item_cases,
    micro_batch,
    oracle_items,
    train_items,
)

WORKER = Path(__file__).with_name("items_worker.py")
LAUNCHED_CASES = 12  # per world size, each under ddp and fsdp


def _one_process(case: ItemCase, **session_args: Any) -> dict[str, list[Any]]:
    with Session(accumulate=case.accumulate, seed=case.seed, **session_args) as session:
        return train_items(session, case, ranks=range(case.world_size))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3).flatmap(item_cases))
def test_single_steps_on_the_global_per_item_mean(case: ItemCase) -> None:
    assert_matches_oracle(_one_process(case, strategy="single"), case)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3).flatmap(item_cases))
def test_dp_steps_on_the_global_per_item_mean(case: ItemCase) -> None:
    # dp refuses a batch of no rows (ScatterError: skip it before the model); ranks' empty parts are
    # concatenated here, so only a micro-step empty on every rank is left out
    assume(all(sum(counts) > 0 for counts in case.counts))
    assert_matches_oracle(_one_process(case, strategy="dp", devices="cpu:2"), case)


def test_a_mean_per_micro_batch_is_not_the_global_mean() -> None:
    # the oracle can tell: ragged micro-batches stepped on the mean of their means land elsewhere
    case = ItemCase(seed=3, world_size=1, accumulate=2, counts=((1,), (5,)))
    with Session(strategy="single", accumulate=2, seed=3) as session:
        model = session.setup_model(build_model(3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
        for x, y in session.batches([micro_batch(case, 0, 0), micro_batch(case, 1, 0)]):
            with session.micro_step(model):
                session.backward(((model(x) - y) ** 2).sum() / x.shape[0])
            session.step(optimizer)
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert (got - oracle_items(case)["parameters"][0]).abs().max() > 1e-3


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_and_fsdp_ranks_step_on_the_global_per_item_mean(tmp_path: Path, world_size: int) -> None:
    cases = draw_cases(world_size, LAUNCHED_CASES)
    (tmp_path / "cases.json").write_text(json.dumps([c.to_json() for c in cases]))
    launch_workers(WORKER, str(tmp_path), str(tmp_path / "cases.json"), nproc=world_size, timeout_s=240)
    results = torch.load(tmp_path / "results.pt")
    assert any(0 in counts for c in cases for counts in c.counts)  # a rank with an empty micro-batch
    for strategy in ("ddp", "fsdp"):
        assert len(results[strategy]) == len(cases)
        for got, case in zip(results[strategy], cases):
            assert_matches_oracle(got, case)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_precisions_step_on_the_global_per_item_mean(precision: str) -> None:
    # float32 model under autocast; fp16's scaler starts high (2**16) and skips the windows whose
    # summed-loss gradients overflow, halving its scale each time, then steps on the exact mean
    counts = ((1, 7), (0, 2), (9, 1), (3, 0), (2, 2)) * 4
    case = ItemCase(seed=5, world_size=2, accumulate=3, counts=counts, max_grad_norm=0.5)
    stepped, losses = [], []
    with Session(strategy="single", precision=precision, accumulate=3, seed=5) as session:
        model = session.setup_model(build_model(5, torch.float32))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
        batches = []
        for step in range(len(case.counts)):
            parts = [micro_batch(case, step, r, torch.float32) for r in range(2)]
            batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
        for x, y in session.batches(batches):  # the last micro-step closes a short window
            with session.micro_step(model):
                session.backward(((model(x) - y) ** 2).sum(), num_items=x.shape[0])
            if session.should_step:
                stepped.append(session.step(optimizer, max_grad_norm=0.5))
                losses.append(session.window_loss)
    assert stepped[-2:] == [True, True]
    assert precision == "fp16" or all(stepped)
    # the oracle: plain PyTorch on one device over each window's items, under the same autocast
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    want = oracle_items(case, autocast, frozenset(i for i, s in enumerate(stepped) if not s))
    got = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    torch.testing.assert_close(got, want["parameters"][-1], rtol=0, atol=1e-2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), rtol=1e-2, atol=0)


def _session_with_model() -> tuple[Session, nn.Module, torch.Tensor, torch.Tensor]:
    session = Session(strategy="single", accumulate=2).start()
    model = session.setup_model(nn.Linear(3, 2))
    return session, model, torch.randn(4, 3), torch.randn(4, 2)


def test_mixing_calls_with_and_without_num_items_in_a_window_is_refused() -> None:
    session, model, x, y = _session_with_model()
    with session.micro_step(model):
        session.backward(((model(x) - y) ** 2).sum(), num_items=4)
    with (
        session.micro_step(model),
        pytest.raises(ConfigError, match=r"called with num_items earlier .* without it now"),
    ):
        session.backward(((model(x) - y) ** 2).mean())
    session.close()


def test_a_window_after_a_mean_window_may_use_num_items() -> None:
    session, model, x, y = _session_with_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for weighted in (False, False, True, True):
        with session.micro_step(model):
            loss = ((model(x) - y) ** 2).sum()
            session.backward(loss, num_items=4) if weighted else session.backward(loss / 4)
        session.step(optimizer)
    assert session.window_loss is not None
    session.close()


@pytest.mark.parametrize(
    ("num_items", "match"),
    [
        (-1, r"num_items=-1 must be the number of items"),
        (2.5, r"num_items=2.5 must be the number of items"),
        (True, r"num_items=True must be the number of items"),
        (torch.ones(2), r"must be one real number"),
    ],
)
def test_a_num_items_that_is_not_a_count_is_refused(num_items: Any, match: str) -> None:
    session, model, x, y = _session_with_model()
    with session.micro_step(model), pytest.raises(ConfigError, match=match):
        session.backward(((model(x) - y) ** 2).sum(), num_items=num_items)
    session.close()


def test_a_loss_that_is_not_one_number_is_refused_with_num_items() -> None:
    session, model, x, y = _session_with_model()
    with session.micro_step(model), pytest.raises(ConfigError, match=r"loss of shape \(4, 2\); pass the SUM"):
        session.backward((model(x) - y) ** 2, num_items=4)
    session.close()


def test_a_window_without_items_does_not_step() -> None:
    session, model, x, y = _session_with_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        with session.micro_step(model):
            session.backward(((model(x[:0]) - y[:0]) ** 2).sum(), num_items=0)
        stepped = session.step(optimizer)
    assert not stepped and session.window_loss is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    session.close()
