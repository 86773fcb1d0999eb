"""The schedulers a live heal sends are the live ones: one the script dropped is not found, even while a reference
cycle keeps it in memory until the cycle collector runs (held off here, so the test does not depend on its timing)."""

from __future__ import annotations

import gc

import torch

from multigpu.session.lr_schedulers import find_schedulers, scheduler_states


class _Holder:
    scheduler: object = None


def test_a_dropped_scheduler_in_a_reference_cycle_is_not_sent() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    enabled = gc.isenabled()
    gc.disable()
    try:
        warmup, holder = torch.optim.lr_scheduler.StepLR(optimizer, 2), _Holder()
        holder.scheduler, warmup.holder = warmup, holder  # type: ignore[attr-defined]  # a cycle through the script's object
        del warmup, holder  # the script replaces its scheduler
        kept = torch.optim.lr_scheduler.StepLR(optimizer, 3)
        assert find_schedulers(optimizer) == [kept]
        assert [s["state"]["step_size"] for s in scheduler_states(optimizer)] == [3]
    finally:
        if enabled:
            gc.enable()
