"""The engines' own cost per step, timed through the engines on a tiny model (planning/step_floors.py)."""

from __future__ import annotations

import torch

from multigpu.planning.calibrate import thread_handoff_s
from multigpu.planning.step_floors import dp_handoff_s, paired_s, tiny_model


def test_the_engines_hand_off_costs_more_than_a_bare_pool_threads() -> None:
    # a woken replica thread takes the GIL from the thread that woke it, at every phase: the bare
    # pool hand-off (a no-op task) the plan charged before read 20 us on the 2 development cores,
    # the engine's 0.2-0.6 ms per replica and phase; the measured dp steps carried the difference
    engine = dp_handoff_s(repeats=30)
    assert engine > 2 * thread_handoff_s()
    assert engine < 0.05  # a hand-off, not a step: well under a scheduler slice's worth per phase
    assert torch.get_num_threads() >= 1  # the caller's intra-op threads are given back


def test_paired_timings_time_each_call_and_keep_a_low_quantile() -> None:
    calls: list[str] = []
    plain, slow = paired_s(lambda: calls.append("a"), lambda: calls.append("b") or sum(range(20_000)), repeats=20)
    assert calls[:2] == ["a", "b"] and calls.count("a") == calls.count("b") == 30  # 10 warm-ups, alternating
    assert 0 <= plain < slow


def test_the_tiny_model_is_the_same_every_time_and_leaves_the_callers_random_stream() -> None:
    torch.manual_seed(1)
    expected = torch.rand(1)
    torch.manual_seed(1)
    first, second = tiny_model(), tiny_model()
    assert torch.rand(1) == expected
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
