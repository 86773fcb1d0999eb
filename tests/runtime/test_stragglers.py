"""The slow rank named: a rank throttled to 1.2x is reported by step 50, a healthy run names nobody.

One real 2-rank gloo launch (tests/runtime/straggler_worker.py: a healthy Session, then one whose rank 1 is
throttled to 1.2x its own step time, then one whose rank 1's loader adds 0.2x its step), read back from the
launcher's output (the main process's reports and the end-of-run summary) and each Session's metrics.csv.
The unit tests below check the verdict's arithmetic, the statistic and the launcher's reading of a garbled
record.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from multigpu.launcher.slow_ranks import summary_lines
from multigpu.runtime.stragglers import SLOW_RATIO, RankTimes, compare, typical_step
from tests.launching import multigpu_launch

WORKER = Path(__file__).with_name("straggler_worker.py")
STEPS = 100  # two windows (steps 1-50 and 51-100) in the healthy and the throttled Session


def _metrics(run_dir: Path) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    with (run_dir / "metrics.csv").open() as file:
        for row in csv.DictReader(file):
            found.setdefault(row["metric"], []).append(float(row["value"]))
    return found


@pytest.mark.multiprocess
def test_a_rank_slowed_by_a_fifth_is_named_by_step_50_and_a_healthy_run_names_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MULTIGPU_CACHE_DIR", raising=False)  # which would win over XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the peak FLOPs measured for mfu go here
    # Unbound: bound to a core each, a healthy rank whose core other jobs take more is slower in every step,
    # and rightly named (a noisy neighbour); unbound, both ranks share the machine's load alike.
    args = ("--strategy", "ddp", "--nproc-per-node", "2", "--no-bind-cores", str(WORKER), str(tmp_path))
    done = multigpu_launch(*args, str(STEPS), "0.04", "1.2", timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout + done.stderr  # the worker's stderr: wherever torchrun forwards it
    reports = [line for line in said.splitlines() if line.startswith("multigpu: rank")]
    # The healthy Session named nobody in two windows; the throttled one once (not again at step 100); the
    # slow loader's once. Each in the first window: by optimizer step 50.
    assert len(reports) == 2, said[-3000:]
    compute, data = reports
    assert compute.startswith("multigpu: rank 1 is slow") and "optimizer steps 1-50 (steps of" in compute
    assert "look at its compute" in compute  # the throttle is in the step, not in the loader
    assert data.startswith("multigpu: rank 1 is slow") and "optimizer steps 1-50 (steps of" in data
    assert "look at its data loading" in data  # rank 0's wait for it in the batch agreement is not its loading
    summary = [line for line in said.splitlines() if line.startswith("multigpu launch (attempt 0): rank 1 is slow")]
    assert len(summary) == 2 and "look at its compute" in summary[0], said[-3000:]  # one line per report
    healthy, slow = _metrics(tmp_path / "healthy"), _metrics(tmp_path / "slow")
    assert len(healthy["slowest_rank_ratio"]) == 2 and max(healthy["slowest_rank_ratio"]) < SLOW_RATIO
    # throughput counts both ranks' samples: 4 per rank per step, each step at least the 40 ms sleep
    for samples_s, step_s in zip(healthy["samples_per_s"], healthy["step_time_s"]):
        assert samples_s * step_s == pytest.approx(2 * 4) and step_s >= 0.04
    assert len(healthy["mfu"]) == len(healthy["samples_per_s"])
    assert slow["slowest_rank"] == [1.0, 1.0]  # each window's verdict, in the logs at steps 50 and 100
    assert min(slow["slowest_rank_ratio"]) >= SLOW_RATIO
    assert _metrics(tmp_path / "slow-data")["slowest_rank"] == [1.0]


def test_the_verdict_compares_the_slowest_rank_with_the_median_of_the_others() -> None:
    times = [RankTimes(0.010, 0.001), RankTimes(0.012, 0.008), RankTimes(0.010, 0.002), RankTimes(0.011, 0.0)]
    verdict = compare(times, 11, 60)
    assert verdict.slowest == 1
    assert verdict.ratio == pytest.approx(0.020 / 0.011)  # median of 0.011, 0.012, 0.011
    assert verdict.slow and "look at its data loading" in verdict.message()
    assert "compute 12.0 ms + data wait 8.0 ms" in verdict.message()
    assert compare([RankTimes(0.010, 0.0), RankTimes(0.0116, 0.0)], 1, 50).slow  # SLOW_RATIO is 1.15
    assert not compare([RankTimes(0.010, 0.0), RankTimes(0.0114, 0.0)], 1, 50).slow


def test_a_rank_whose_extra_time_is_a_small_share_of_the_step_is_not_named() -> None:
    """Own times of 0.5 against 0.6 ms in a 13 ms step (the rest backward and all-reduce): 1.2x, but 0.8% of
    the step, a loaded core's noise; the same times in a 4 ms step are 2.5% of it."""
    times = [RankTimes(0.0005, 0.0), RankTimes(0.0006, 0.0)]
    assert compare(times, 1, 50, step_s=0.013).ratio == pytest.approx(1.2)
    assert not compare(times, 1, 50, step_s=0.013).slow
    assert compare(times, 1, 50, step_s=0.004).slow


def test_a_ranks_typical_step_is_its_fastest_quarter() -> None:
    """Load only adds time, and to some steps (a descheduled process, a first log, a save): they are left out,
    however long (here 30 of 50 steps, twice as long); a rank slow in every step is slow in its fastest too."""
    loaded = [(0.010, 0.001)] * 20 + [(0.020, 0.002)] * 30
    assert typical_step(loaded).compute_s == pytest.approx(0.010)
    assert typical_step(loaded).data_wait_s == pytest.approx(0.001)
    throttled = [(0.012 + i * 1e-5, 0.0) for i in range(50)]  # 1.2x, in every step: the fastest 12 steps' mean
    assert typical_step(throttled).compute_s == pytest.approx(0.012 + 5.5e-5)
    assert typical_step([(0.5, 0.0)]).compute_s == 0.5  # a window of one step keeps it


def test_the_launcher_repeats_the_record_and_names_a_garbled_one(tmp_path: Path) -> None:
    record = {
        "rank": 1,
        "ratio": 1.5,
        "step_s": 0.03,
        "first_step": 2,
        "last_step": 51,
        "times": [{"compute_s": 0.01, "data_wait_s": 0.0}, {"compute_s": 0.015, "data_wait_s": 0.0}],
    }
    (tmp_path / "slow-rank-attempt-0-1.json").write_text(json.dumps(record))
    (tmp_path / "slow-rank-attempt-0-2.json").write_text(json.dumps({**record, "rank": 0}))  # a second Session's
    (tmp_path / "slow-rank-attempt-1-1.json").write_text(json.dumps({**record, "rank": 7}))
    (tmp_path / "slow-rank-attempt-2-1.json").write_text("[1e999]")
    lines = summary_lines(tmp_path)
    assert lines[0].startswith("multigpu launch (attempt 0): rank 1 is slow: 1.50x")
    assert "optimizer steps 2-51 (steps of 30.0 ms)" in lines[0]
    assert lines[1].startswith("multigpu launch (attempt 0): rank 0 is slow: 1.50x")
    assert "slow-rank-attempt-1-1.json was skipped: it names rank 7 of 2 ranks" in lines[2]
    assert "slow-rank-attempt-2-1.json was skipped" in lines[3]
    assert summary_lines(tmp_path / "missing") == []
