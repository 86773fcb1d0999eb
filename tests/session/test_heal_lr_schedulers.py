"""A replica group healed live goes on with the sender's learning-rate schedule (issue 31).

In one process, through :class:`LiveState` as torchft drives it: a healthy group's state (through
``torch.save``/``torch.load``, as torchft's HTTP transport sends it) is applied to a group whose
optimizer and scheduler were just built, before its first ``session.step`` (a restart) or after (a
heal inside a step). The oracle is the sender itself: from the heal on, both step the same gradients
and their schedulers, and every learning rate and weight must be bit-identical, for many steps.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched

from multigpu.session.fault_tolerance import LiveState

HEAL_AT, TOTAL = 7, 40


def _plateau_metric(step: int) -> float:
    return 1.0 / (1 + min(step, 3))  # improves, then stalls: the scheduler cuts the rate every few steps


KINDS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda opt: sched.StepLR(opt, step_size=3, gamma=0.5),
    "MultiStepLR": lambda opt: sched.MultiStepLR(opt, milestones=[5, 9, 20], gamma=0.5),
    "LambdaLR": lambda opt: sched.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "OneCycleLR": lambda opt: sched.OneCycleLR(opt, max_lr=1.0, total_steps=TOTAL + 1),
    "SequentialLR": lambda opt: sched.SequentialLR(
        opt, [sched.LinearLR(opt, start_factor=0.1, total_iters=4), sched.ExponentialLR(opt, gamma=0.9)], [4]
    ),
    "ChainedScheduler": lambda opt: sched.ChainedScheduler(
        [sched.ConstantLR(opt, factor=0.5, total_iters=10), sched.ExponentialLR(opt, gamma=0.95)]
    ),
    "ReduceLROnPlateau": lambda opt: sched.ReduceLROnPlateau(opt, patience=1, factor=0.5),
    "CosineAnnealingWarmRestarts": lambda opt: sched.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2),
}


class Group:
    """One replica group's model, optimizer and scheduler, built as the script builds them."""

    def __init__(self, kind: str) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.scheduler = KINDS[kind](self.optimizer)
        self.live = LiveState()
        self.live.model = self.model

    def step(self, step: int) -> None:
        """One committed step: the same gradients in every group, then the script's scheduler step."""
        for index, param in enumerate(self.model.parameters()):
            param.grad = torch.full_like(param, 0.01 * (step + 1) * (index + 1))
        self.optimizer.step()
        if isinstance(self.scheduler, sched.ReduceLROnPlateau):
            self.scheduler.step(_plateau_metric(step))
        else:
            self.scheduler.step()

    def lrs(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]


def _sent(live: LiveState) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(live.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# each scheduler found both ways, each way of healing (about 0.3 s a case: every lookup scans the objects)
CASES = [(kind, False, False) for kind in sorted(KINDS)] + [(kind, True, True) for kind in sorted(KINDS)]
CASES.append(("StepLR", False, True))


@pytest.mark.parametrize(("kind", "inside_step", "materialized"), CASES)
def test_a_healed_groups_scheduler_goes_on_as_the_senders(kind: str, inside_step: bool, materialized: bool) -> None:
    sender = Group(kind)
    sender.live.attach_optimizer(sender.optimizer)
    for step in range(HEAL_AT):
        sender.step(step)
    if materialized:  # a scheduler whose __dict__ was read refers to the optimizer through that dict (Python 3.11)
        sender.scheduler.state_dict()
    state = _sent(sender.live)

    healed = Group(kind)
    if materialized:
        healed.scheduler.state_dict()
    if inside_step:  # a group alive but behind: its optimizer was seen, torchft applies the state in its commit
        healed.live.attach_optimizer(healed.optimizer)
        healed.live.load_state_dict(state, inside_step=True)
    else:  # a restarted group: the state arrives before its first session.step, which attaches the optimizer
        healed.live.load_state_dict(state)
        healed.live.attach_optimizer(healed.optimizer)

    assert healed.lrs() == sender.lrs()
    lrs = set()
    for step in range(HEAL_AT, TOTAL):
        sender.step(step)
        healed.step(step)
        assert healed.lrs() == sender.lrs(), (step, healed.lrs(), sender.lrs())
        lrs.add(tuple(sender.lrs()))
        for ours, theirs in zip(healed.model.parameters(), sender.model.parameters()):
            assert torch.equal(ours, theirs), step
    assert len(lrs) > 2, "the schedule did not change the rate after the heal: the test would not see a drift"


def test_the_schedulers_inside_a_chain_are_sent_in_the_chains_state_only() -> None:
    group = Group("SequentialLR")
    group.live.attach_optimizer(group.optimizer)
    (sent,) = group.live.state_dict()["schedulers"]
    assert [s["kind"] for s in sent] == ["torch.optim.lr_scheduler.SequentialLR"]
    assert len(sent[0]["state"]["_schedulers"]) == 2


def test_a_scheduler_without_a_counterpart_in_the_healed_group_is_named_in_a_warning() -> None:
    sender = Group("StepLR")
    sender.live.attach_optimizer(sender.optimizer)
    state = _sent(sender.live)
    healed = Group("LambdaLR")  # the script built another scheduler here: nothing to match
    healed.live.load_state_dict(state)
    with pytest.warns(RuntimeWarning) as warned:
        healed.live.attach_optimizer(healed.optimizer)
    messages = [str(w.message) for w in warned]
    assert any("healthy replica group's torch.optim.lr_scheduler.StepLR on optimizer 0" in m for m in messages)
    assert any("group's torch.optim.lr_scheduler.LambdaLR on optimizer 0 received no state" in m for m in messages)
