"""Drawn token-weighted runs (``session.backward(loss_sum, num_items=n)``) and their one-device oracle.

An :class:`ItemCase` is plain data (it travels to the gloo workers as JSON): a world size, an
accumulation count and, for every micro-step, each rank's item count (zero included). Its items
are drawn from its seed, so the Session's ranks (:func:`train_items`) and the oracle
(:func:`oracle_items`: plain PyTorch on one device over the window's items, summed loss divided by
their count, float64) see the same ones. Shared by ``test_items.py`` and ``items_worker.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from multigpu.session import Session

INPUTS, OUTPUTS = 3, 2


@dataclass(frozen=True, kw_only=True)
class ItemCase:
    seed: int
    world_size: int
    accumulate: int
    counts: tuple[tuple[int, ...], ...]  # [micro-step][rank]: that rank's items in that micro-batch
    max_grad_norm: float | None = None
    tensor_counts: bool = False  # num_items as a 0-dim tensor instead of an int
    momentum: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> ItemCase:
        return ItemCase(**{**data, "counts": tuple(tuple(c) for c in data["counts"])})


def item_cases(world_size: int) -> st.SearchStrategy[ItemCase]:
    """Hypothesis's cases for ``world_size`` ranks: ragged counts 0-5, accumulate 1-4, 1-7 micro-steps."""
    counts = st.lists(st.tuples(*[st.integers(0, 5)] * world_size).map(tuple), min_size=1, max_size=7).map(tuple)
    return st.builds(
        ItemCase,
        seed=st.integers(0, 2**31 - 1),
        world_size=st.just(world_size),
        accumulate=st.integers(1, 4),
        counts=counts,
        max_grad_norm=st.one_of(st.none(), st.floats(0.05, 5.0)),
        tensor_counts=st.booleans(),
        momentum=st.sampled_from([0.0, 0.5]),
    )


def draw_cases(world_size: int, count: int) -> list[ItemCase]:
    """``count`` cases drawn by hypothesis (derandomized: the same on every run) for a launched worker."""
    drawn: list[ItemCase] = []

    @settings(max_examples=count, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(item_cases(world_size))
    def collect(case: ItemCase) -> None:
        drawn.append(case)

    collect()
    return drawn[:count]


def build_model(seed: int, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(INPUTS, 4), nn.Tanh(), nn.Linear(4, OUTPUTS)).to(dtype)


def micro_batch(case: ItemCase, step: int, rank: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s items of micro-step ``step``: inputs ``[n, 3]`` and targets ``[n, 2]``."""
    n = case.counts[step][rank]
    generator = torch.Generator().manual_seed(case.seed * 1009 + step * 31 + rank)
    x = torch.randn(n, INPUTS, generator=generator, dtype=torch.float64)
    y = torch.randn(n, OUTPUTS, generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def item_loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed per-item loss (an item: one row's squared error over its outputs)."""
    return ((model(x) - y) ** 2).sum()


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter in one float64 vector (a sharded one gathered whole: every rank must call it)."""
    parts = []
    for param in model.parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        parts.append(full.detach().to(torch.float64).reshape(-1).cpu())
    return torch.cat(parts)


def train_items(session: Session, case: ItemCase, *, ranks: range | None = None) -> dict[str, list[Any]]:
    """The case through the Session: this process's rank's micro-batches (every rank's, concatenated, in one
    process). Returns the parameters and ``window_loss`` after every window, and whether each stepped."""
    model = session.setup_model(build_model(case.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=case.momentum)
    mine = ranks if ranks is not None else range(session.global_rank, session.global_rank + 1)
    batches = []
    for step in range(len(case.counts)):
        parts = [micro_batch(case, step, r) for r in mine]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    out: dict[str, list[Any]] = {"parameters": [], "losses": [], "stepped": []}
    for x, y in session.batches(batches):
        with session.micro_step(model):
            loss = item_loss_sum(model, x, y)
            count = torch.tensor(x.shape[0]) if case.tensor_counts else x.shape[0]
            session.backward(loss, num_items=count)
        ends = session.should_step
        stepped = session.step(optimizer, max_grad_norm=case.max_grad_norm)
        if ends:
            out["parameters"].append(flat_parameters(model))
            out["losses"].append(session.window_loss)
            out["stepped"].append(stepped)
    return out


def windows(case: ItemCase) -> list[range]:
    """The micro-steps of each accumulation window (the last one short when the steps run out)."""
    steps = len(case.counts)
    return [range(start, min(start + case.accumulate, steps)) for start in range(0, steps, case.accumulate)]


def oracle_items(
    case: ItemCase, autocast: torch.dtype | None = None, skipped: frozenset[int] = frozenset()
) -> dict[str, list[Any]]:
    """Plain PyTorch on one device: each window's items of every rank, summed loss / their count, float64
    (float32 under ``autocast`` to that dtype); the ``skipped`` windows (fp16's overflows) do not step."""
    dtype = torch.float64 if autocast is None else torch.float32
    model = build_model(case.seed, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=case.momentum)
    out: dict[str, list[Any]] = {"parameters": [], "losses": [], "stepped": []}
    for index, window in enumerate(windows(case)):
        parts = [micro_batch(case, step, r, dtype) for step in window for r in range(case.world_size)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        stepped = x.shape[0] > 0
        loss = None
        if stepped:
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = ((model(x) - y) ** 2).sum() / x.shape[0]
            loss.backward()
            if case.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), case.max_grad_norm)
            if index not in skipped:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out["parameters"].append(flat_parameters(model))
        out["losses"].append(None if loss is None else loss.item())
        out["stepped"].append(stepped)
    return out


def assert_matches_oracle(got: dict[str, list[Any]], case: ItemCase, tolerance: float = 1e-10) -> None:
    want = oracle_items(case)
    assert got["stepped"] == want["stepped"], case
    assert len(got["parameters"]) == len(want["parameters"]), case
    for i, (g, w) in enumerate(zip(got["parameters"], want["parameters"])):
        torch.testing.assert_close(g, w, rtol=0, atol=tolerance, msg=lambda m, i=i: f"window {i} of {case}: {m}")
    for g, w in zip(got["losses"], want["losses"]):
        assert (g is None) == (w is None), case
        if w is not None:
            assert abs(g - w) <= tolerance * max(1.0, abs(w)), (g, w, case)
