"""The demo's DDP run: real processes through multigpu launch, weights and metrics back."""

from __future__ import annotations

import pytest

from multigpu.session.digits import build_digits_model, run_ddp_digits

pytestmark = pytest.mark.multiprocess


def test_ddp_digits_run_returns_trained_weights_and_metrics() -> None:
    result = run_ddp_digits(nproc_per_node=2, epochs=1, lr=0.2, timeout_s=120)
    assert result.world_size == 2 and result.strategy == "ddp"
    assert len(result.losses) == 1797 // 64
    assert result.losses[-1] < result.losses[0]
    assert result.accuracy > 0.6
    build_digits_model().load_state_dict(result.state_dict)  # bare keys: no "module." prefix
    assert result.ms_per_step > 0 and result.seconds > 0
