"""Uneven chunks, loss on the replicas, and auto-balance, against the one-device oracle."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

import multigpu
from multigpu.errors import ConfigError
from multigpu.parallel.balance import water_fill
from tests.models import TinyLM, assert_same_grads, mlp, twin


class CountRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.rows: list[int] = []
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.rows.append(x.size(0))
        return self.lin(x)


def test_fixed_sizes_and_a_zero_share() -> None:
    net = CountRows()
    multigpu.DataParallel(net, devices="cpu:3", chunk_sizes=[2, 0, 5])(torch.randn(7, 8))
    assert sorted(net.rows) == [2, 5]
    net.rows.clear()
    multigpu.DataParallel(net, devices="cpu:2", chunk_sizes=[0.0, 1.0])(torch.randn(4, 8))
    assert net.rows == [4]


@pytest.mark.parametrize("criterion", [nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum")])
def test_loss_on_the_replicas_equals_the_whole_batch_loss(criterion: nn.Module) -> None:
    net, ref = twin(mlp)
    model = multigpu.DataParallel(net, devices="cpu:3", loss_fn=criterion, chunk_sizes=[0.2, 0.5, 0.3])
    x, y = torch.randn(11, 8), torch.randint(0, 3, (11,))
    loss = model(x, target=y)
    want = criterion(ref(x), y)
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    assert_same_grads(net, ref)
    outs = model.replica_outputs
    assert [o.size(0) for o in outs] == [2, 6, 3]  # per replica, still on its device
    torch.testing.assert_close(torch.cat(outs), ref(x).detach())


def test_models_that_return_their_own_loss_keep_outputs_on_the_replicas() -> None:
    net, ref = twin(TinyLM)
    model = multigpu.DataParallel(net, devices="cpu:2", gather_outputs=False)
    ids = torch.randint(0, 50, (5, 16))
    out = model(input_ids=ids, labels=ids)
    want = ref(input_ids=ids, labels=ids)
    assert out.logits is None and out.hidden is None
    torch.testing.assert_close(out.loss, want.loss)
    out.loss.backward()
    want.loss.backward()
    assert_same_grads(net, ref, atol=1e-5, rtol=1e-4)
    assert [o.logits.shape[0] for o in model.replica_outputs] == [3, 2]


def test_loss_fn_without_targets_returns_the_outputs_for_inference() -> None:
    net, ref = twin(mlp)
    model = multigpu.DataParallel(net, devices="cpu:2", loss_fn=nn.CrossEntropyLoss()).eval()
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


@pytest.mark.parametrize("devices", ["cpu:2", "cpu:1"])
def test_target_without_loss_fn_says_it_needs_loss_fn(devices: str) -> None:
    """nn.Linear takes no ``target=``: the caller meant loss_fn=, say so before any replica runs (was a TypeError)."""
    net = CountRows()
    model = multigpu.DataParallel(net, devices=devices)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    with pytest.raises(ConfigError, match=r"target=\.\.\.\) needs loss_fn=: CountRows\.forward takes no target"):
        model(x, target=y)
    assert net.rows == []


class OwnLoss(nn.Module):
    """A model that takes the targets itself (as transformers' ``labels=``): ``target=`` is its own kwarg."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        out = self.lin(x)
        return out if target is None else nn.functional.cross_entropy(out, target)


class AnyKwargs(OwnLoss):
    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return super().forward(x, kwargs.get("target"))


@pytest.mark.parametrize("kind", [OwnLoss, AnyKwargs])
def test_target_still_reaches_a_forward_that_takes_it(kind: type[nn.Module]) -> None:
    """Without loss_fn every kwarg goes to the module, as in nn.DataParallel: the replica losses, combined."""
    torch.manual_seed(0)
    net, ref = twin(kind)
    x, y = torch.randn(7, 8), torch.randint(0, 3, (7,))
    loss = multigpu.DataParallel(net, devices="cpu:2")(x, target=y)  # 0-dim outputs: mean weighted by chunk
    want = ref(x, target=y)
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    assert_same_grads(net, ref)


def test_loss_fn_needs_a_combinable_reduction() -> None:
    with pytest.raises(ConfigError, match=r"loss reduction 'none' cannot be combined across replicas, only mean, sum"):
        multigpu.DataParallel(mlp(), devices="cpu:2", loss_fn=nn.CrossEntropyLoss(reduction="none"))


def test_water_fill_equalises_predicted_peaks() -> None:
    assert water_fill([100.0, 0.0], [1.0, 1.0], 200) == [50, 150]
    assert water_fill([500.0, 0.0, 0.0], [1.0, 1.0, 1.0], 100) == [0, 50, 50]
    assert sum(water_fill([3.0, 1.0, 2.0], [0.5, 1.0, 2.0], 37)) == 37


def test_water_fill_with_per_sample_costs_too_small_for_a_float_ratio() -> None:
    # found by the planner's property test: 2e-313 bytes of activations per sample overflowed a share
    tiny = 2.2250738585e-313
    assert water_fill([2.0**33, 2.0**32, 2.0**32], [tiny] * 3, 48) == [0, 24, 24]
    assert water_fill([100.0, 0.0], [tiny, tiny], 6) == [0, 6]
    assert water_fill([2.0**40, 2.0**40], [tiny, tiny], 5) == [3, 2]


class BigHead(nn.Module):
    """Small body, large output: the classic case where the primary's gathered outputs dominate."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _train(model: nn.Module, params: nn.Module, batches: list[torch.Tensor], use_loss_fn: bool) -> list[float]:
    optimizer = torch.optim.Adam(params.parameters(), lr=1e-2)
    losses = []
    for x in batches:
        optimizer.zero_grad()
        target = torch.zeros(x.size(0), dtype=torch.long)
        loss = model(x, target=target) if use_loss_fn else nn.functional.cross_entropy(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def test_auto_balance_trains_exactly_like_one_device_and_logs_its_plan_once(caplog: pytest.LogCaptureFixture) -> None:
    net, ref = twin(BigHead)
    model = multigpu.DataParallel(net, devices="cpu:2", loss_fn=nn.CrossEntropyLoss(), chunk_sizes="auto")
    batches = [torch.randn(64, 8) for _ in range(4)] + [torch.randn(10, 8) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="multigpu.balance"):
        got = _train(model, net, batches, use_loss_fn=True)
    want = _train(ref, ref, batches, use_loss_fn=False)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert sorted(model.balance_plans) == [10, 64]  # re-planned when the batch size changed
    assert len([r for r in caplog.records if "auto-balance for batch 64" in r.message]) == 1
    plan = model.balance_plans[64]
    assert sum(plan.sizes) == 64 and plan.sizes[0] < plan.sizes[1]  # the primary carries the optimizer state


def test_auto_balance_is_deterministic() -> None:
    plans = []
    for _ in range(2):
        torch.manual_seed(0)
        net = BigHead()
        model = multigpu.DataParallel(net, devices="cpu:2", chunk_sizes="auto")
        _train(model, net, [torch.randn(48, 8) for _ in range(3)], use_loss_fn=False)
        plans.append(model.balance_plans[48].sizes)
    assert plans[0] == plans[1]
