"""A replica group healed live takes up the sender's fp16 gradient scale (issue 31).

A group at another scale than the others skips other steps (an overflow at its scale only) and, under
``--fault-tolerant``, all-reduces gradients scaled otherwise than theirs. In one process, through
:class:`LiveState` as torchft drives it: after the heal both train the same growing batches, and every
skip decision, scale and weight must be the sender's (the oracle).
"""

from __future__ import annotations

import torch
from torch import nn

from multigpu.session.fault_tolerance import LiveState
from multigpu.strategies.precision import build_precision


class Group:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-6)
        self.precision = build_precision("fp16", "cpu")
        self.live = LiveState()
        self.live.model, self.live.precision = self.model, self.precision

    def step(self, size: float) -> bool:
        x = torch.full((8, 4), 0.01)
        with self.precision.autocast():
            loss = ((self.model(x).float() - size) ** 2).mean()
        self.precision.scale_loss(loss).backward()
        stepped = self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return stepped


def test_a_healed_group_takes_up_the_senders_gradient_scale() -> None:
    sender = Group()
    sender.live.attach_optimizer(sender.optimizer)
    assert sender.step(0.0)
    assert not sender.step(1e4)  # overflows at the initial scale: skipped, the scale halves
    healed = Group()
    healed.live.load_state_dict(sender.live.state_dict())
    healed.live.attach_optimizer(healed.optimizer)
    assert healed.precision.state_dict() == sender.precision.state_dict()
    decisions = []
    for size in [2.0**k for k in range(-3, 10)]:  # larger gradients: each scale overflows from some size on
        stepped = sender.step(size)
        assert healed.step(size) == stepped, size
        decisions.append(stepped)
        for ours, theirs in zip(healed.model.parameters(), sender.model.parameters()):
            assert torch.equal(ours, theirs), size
    assert True in decisions and False in decisions  # both kinds of step happened after the heal
