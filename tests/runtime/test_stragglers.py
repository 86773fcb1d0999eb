"""The slow rank named: a rank slowed on purpose is reported within 50 steps, a healthy run names nobody.

One real 2-rank gloo launch (tests/runtime/straggler_worker.py: a healthy Session, then one whose rank 1
sleeps 1.4x as long in each step), read back from the launcher's output (the main process's report and the
end-of-run summary) and each Session's metrics.csv. The unit tests below check the verdict's arithmetic and
the launcher's reading of a garbled record.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from multigpu.launcher.slow_ranks import summary_lines
from multigpu.runtime.stragglers import SLOW_RATIO, RankTimes, compare, typical_step
from tests.launching import launch_workers

WORKER = Path(__file__).with_name("straggler_worker.py")
STEPS = 61  # the first step is not timed: steps 2-51 are one window of 50; logs at 10, 20, ..., 60 and 61


def _metrics(run_dir: Path) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    with (run_dir / "metrics.csv").open() as file:
        for row in csv.DictReader(file):
            found.setdefault(row["metric"], []).append(float(row["value"]))
    return found


@pytest.mark.multiprocess
def test_a_slowed_rank_is_named_once_and_a_healthy_run_names_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MULTIGPU_CACHE_DIR", raising=False)  # which would win over XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the peak FLOPs measured for mfu go here
    # The sleep is 1.4x: the threshold is 1.2, and the model's own compute and the sleeps' overshoot on a
    # loaded machine add the same milliseconds to both ranks, which pulls the measured ratio down (1.3x read 1.24)
    done = launch_workers(WORKER, str(tmp_path), str(STEPS), "0.02", "1.4")
    said = done.stdout + done.stderr  # the worker's stderr: wherever torchrun forwards it
    reports = [line for line in said.splitlines() if line.startswith("multigpu: rank")]
    assert len(reports) == 1, said[-3000:]  # the healthy Session reported nobody, the slow one once
    assert reports[0].startswith("multigpu: rank 1 is slow") and "optimizer steps 2-51 (steps of" in reports[0]
    assert "look at its compute" in reports[0]  # the sleep is in the step, not in the loader
    summary = [line for line in said.splitlines() if line.startswith("multigpu launch (attempt 0): rank 1 is slow")]
    assert len(summary) == 1, said[-3000:]
    healthy, slow = _metrics(tmp_path / "healthy"), _metrics(tmp_path / "slow")
    assert len(healthy["slowest_rank_ratio"]) == 1 and healthy["slowest_rank_ratio"][0] < SLOW_RATIO
    # throughput counts both ranks' samples: 4 per rank per step, each step at least the 20 ms sleep
    for samples_s, step_s in zip(healthy["samples_per_s"], healthy["step_time_s"]):
        assert samples_s * step_s == pytest.approx(2 * 4) and step_s >= 0.02
    assert len(healthy["mfu"]) == len(healthy["samples_per_s"])
    assert slow["slowest_rank"] == [1.0]  # the window's verdict, in the first log after step 51 only
    assert slow["slowest_rank_ratio"][0] >= SLOW_RATIO


def test_the_verdict_compares_the_slowest_rank_with_the_median_of_the_others() -> None:
    times = [RankTimes(0.010, 0.001), RankTimes(0.012, 0.008), RankTimes(0.010, 0.002), RankTimes(0.011, 0.0)]
    verdict = compare(times, 11, 60)
    assert verdict.slowest == 1
    assert verdict.ratio == pytest.approx(0.020 / 0.011)  # median of 0.011, 0.012, 0.011
    assert verdict.slow and "look at its data loading" in verdict.message()
    assert "compute 12.0 ms + data wait 8.0 ms" in verdict.message()
    assert not compare([RankTimes(0.010, 0.0), RankTimes(0.0115, 0.0)], 1, 50).slow


def test_a_one_off_step_does_not_make_a_rank_slow() -> None:
    """A first log or a checkpoint the main process writes takes one long step: the window's slowest tenth is left out."""
    steady = [(0.010, 0.0)] * 45
    assert typical_step([*steady, (0.5, 0.0)] + [(0.010, 0.0)] * 4).compute_s == pytest.approx(0.010)


def test_the_launcher_repeats_the_record_and_names_a_garbled_one(tmp_path: Path) -> None:
    record = {
        "rank": 1,
        "ratio": 1.5,
        "step_s": 0.03,
        "first_step": 2,
        "last_step": 51,
        "times": [{"compute_s": 0.01, "data_wait_s": 0.0}, {"compute_s": 0.015, "data_wait_s": 0.0}],
    }
    (tmp_path / "slow-rank-attempt-0.json").write_text(json.dumps(record))
    (tmp_path / "slow-rank-attempt-1.json").write_text(json.dumps({**record, "rank": 7}))
    (tmp_path / "slow-rank-attempt-2.json").write_text("[1e999]")
    lines = summary_lines(tmp_path)
    assert lines[0].startswith("multigpu launch (attempt 0): rank 1 is slow: 1.50x")
    assert "optimizer steps 2-51 (steps of 30.0 ms)" in lines[0]
    assert "slow-rank-attempt-1.json was skipped: it names rank 7 of 2 ranks" in lines[1]
    assert "slow-rank-attempt-2.json was skipped" in lines[2]
    assert summary_lines(tmp_path / "missing") == []
