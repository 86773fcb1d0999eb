"""The fault-tolerant step's sums through DDP's buckets and after backward, against plain ddp over as many processes.

The oracle is one ddp run of the same script over every group's processes (itself held to one device by
tests/session/test_ddp_equivalence.py): the weights of every group after each step are its ranks', for a
parameter that has a gradient in one group only (a branch taken by one group's batches: DDP, whose world is
the group, left it None on the other, which never moved it), odd batches with a short last one, gradient
accumulation, buckets of one or two parameters, a frozen parameter, ``zero_grad(set_to_none=False)`` and the
script's own comm hook.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.launching import launch_workers, multigpu_launch

pytestmark = pytest.mark.multiprocess

WORKER = "tests/launcher/ft_step_cases_worker.py"
STEPS = "6"


def _weights(out: Path, processes: int) -> list[list[list[float]]]:
    return [
        [json.loads(line)["weights"] for line in (out / f"replica{i}.jsonl").read_text().splitlines()]
        for i in range(processes)
    ]


def _compare(tmp_path: Path, case: str, per_group: int, tolerance: float = 1e-6) -> None:
    oracle, groups = tmp_path / "ddp", tmp_path / "groups"
    oracle.mkdir(parents=True)
    groups.mkdir(parents=True)
    launch_workers(WORKER, str(oracle), case, STEPS, nproc=2 * per_group, timeout_s=120)
    done = multigpu_launch(
        "--strategy", "ddp", "--fault-tolerant", "--replicas", "2", "--nproc-per-node", str(per_group),
        WORKER, str(groups), case, STEPS, timeout_s=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    want, got = _weights(oracle, 2 * per_group), _weights(groups, 2 * per_group)
    for process, (theirs, ours) in enumerate(zip(want, got)):
        assert len(ours) == len(theirs) == len(got[0]), process
        for step, (a, b, first) in enumerate(zip(theirs, ours, got[0])):
            assert max(abs(x - y) for x, y in zip(a, b)) < tolerance, (process, step)
            assert max(abs(x - y) for x, y in zip(first, b)) < 1e-6, (process, step)  # the groups alike


def test_every_group_holds_plain_ddps_weights_after_each_step(tmp_path: Path) -> None:
    _compare(tmp_path, "unused,odd,accumulate,small", per_group=1)  # summed in backward over many buckets


@pytest.mark.skipif(
    not os.environ.get("MULTIGPU_LONG"), reason="three pairs of launches (110 s at a load of 5): MULTIGPU_LONG=1"
)
def test_a_comm_hook_of_the_scripts_a_frozen_parameter_and_groups_of_two_processes(tmp_path: Path) -> None:
    # the script's own comm hook (fp16 inside the group): summed after backward; fp16's rounding apart from ddp's
    _compare(tmp_path / "hook", "fp16_hook,unused,frozen,keep_grads", per_group=1, tolerance=1e-3)
    _compare(tmp_path / "plain", "odd,accumulate,frozen,keep_grads", per_group=1)
    _compare(tmp_path / "two", "unused", per_group=2)  # summed after backward (DDP sums inside each group first)
