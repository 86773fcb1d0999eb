"""The collectives the planner counts for an fsdp step are those a real 2-process fsdp step issues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multigpu.planning.costs import fsdp_collectives
from multigpu.planning.counting import count_fsdp_groups
from multigpu.planning.workload import FsdpLayout, Workload
from multigpu.strategies.fsdp import FSDPOptions, select_blocks
from tests.launching import multigpu_launch
from tests.planning._reference_nets import small_cnn

WORKER = Path(__file__).with_name("fsdp_collectives_worker.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_cnns_fsdp_step_issues_the_all_gathers_and_reduce_scatters_the_planner_counts(tmp_path: Path) -> None:
    model = small_cnn()
    groups = count_fsdp_groups(model, select_blocks(model, FSDPOptions()))
    assert len(groups) == 5  # the root (BatchNorm's weights) and four blocks: three convolutions and the head
    params = sum(p.numel() for p in model.parameters())
    w = Workload(name="cnn", params=params, compute_s_per_sample=1e-3, fsdp=FsdpLayout(groups=groups))

    out = tmp_path / "collectives.json"
    done = multigpu_launch("--strategy", "fsdp", "--nproc-per-node", "2", str(WORKER), str(out), timeout_s=200)
    assert done.returncode == 0, done.stderr[-3000:]
    issued = json.loads(out.read_text())["counts"]
    assert issued == fsdp_collectives(w) == {"all-gather": 9, "reduce-scatter": 5}
