"""The Session's differential fuzzer: drawn models trained under single, dp and ddp end with one device's weights.

Each case (tests/session/fuzz_cases.py) draws a small model from a vocabulary (Linear, grouped
Conv1d, LayerNorm, GRU, Embedding input, a submodule used twice, tied weights), a dataset, a global
batch, accumulation 1-3, SGD with or without momentum, and build_loader or the user's own
DataLoader. The oracle is a plain PyTorch loop on one device over the same global batches.

CI runs a fixed-seed profile: a few cases in this process (single and dp) and a few in the one ddp
launch of two gloo processes the session tests share (tests/session/conftest.py), which trains
them all in the same workers. ``MULTIGPU_FUZZ_EXAMPLES=2000`` runs a long one.

Tolerance (float32): rtol 1e-4, atol 1e-5 on every weight. The strategies add the same
per-sample gradients in another order (two replicas' or two ranks' sums, then the all-reduce;
the oracle sums one batch), which moves each gradient by a few float32 ulps (~1e-7 relative), and
up to ~36 momentum steps grow that. The long run (2,000 drawn cases for single and dp, 2,000 for
ddp) saw at most |dw| = 4.5e-06, so the bound holds with room; a wrong batch, a wrong scale (an
accumulation or averaging bug) or a missed step moves the weights by 1e-3 or more.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.session.fuzz_cases import EXAMPLES, Case, ddp_cases, draw_case, plain_train, run_case

RTOL, ATOL = 1e-4, 1e-5
WORST = {"abs": 0.0, "rel": 0.0}  # the largest differences seen, printed by a long run (pytest -s)


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], case: Case) -> None:
    assert list(got) == list(want), case
    for key in want:
        diff = (got[key] - want[key]).abs()
        WORST["abs"] = max(WORST["abs"], float(diff.max()))
        WORST["rel"] = max(WORST["rel"], float((diff / (want[key].abs() + ATOL)).max()))
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}\n{case}")


@settings(max_examples=EXAMPLES or 8, derandomize=True, deadline=None)
@given(st.randoms(use_true_random=False))
def test_single_and_dp_end_with_the_weights_of_one_device(rng: random.Random) -> None:
    case = draw_case(rng)
    want = plain_train(case)
    assert_same_weights(run_case(case, "single"), want, case)
    assert_same_weights(run_case(case, "dp", devices="cpu:2"), want, case)
    if EXAMPLES:
        print(f"single/dp so far: largest |dw| {WORST['abs']:.2e}, largest |dw|/(|w|+atol) {WORST['rel']:.2e}")


@pytest.mark.multiprocess
def test_ddp_on_two_processes_ends_with_the_weights_of_one_device(ranks: list[dict[str, Any]]) -> None:
    cases = ddp_cases()
    for rank in ranks:
        assert len(rank["fuzz"]) == len(cases)
    for case, got0, got1 in zip(cases, ranks[0]["fuzz"], ranks[1]["fuzz"]):
        want = plain_train(case)
        assert_same_weights(got0, want, case)
        for key in got0:  # the ranks hold one model
            assert torch.equal(got0[key], got1[key]), (key, case)
    if EXAMPLES:
        print(f"ddp, {len(cases)} cases: largest |dw| {WORST['abs']:.2e}, largest |dw|/(|w|+atol) {WORST['rel']:.2e}")
