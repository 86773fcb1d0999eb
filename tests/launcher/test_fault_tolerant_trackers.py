"""A fault-tolerant launch keeps one tracker run when the main process's group is killed and restarted.

Rank 0 of replica group 0 writes the trackers. Here it is SIGKILLed after it logged some steps; the launcher
restarts group 0, which heals live from group 1 (no checkpoint) and logs on. Read back through each tracker's
own reader (the csv module, TensorBoard's event accumulator, the MLflow client): one run, which holds the steps
of both processes of group 0, each step at most once and in order; the steps committed while group 0 was
down are not in it. MLflow's import and first database take a loaded machine tens of seconds in each process
of group 0: the launch with it runs with MULTIGPU_LONG=1, the CSV and TensorBoard one always.
"""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path

import pytest

from multigpu.session.metrics import RUN_RECORD
from tests.launcher.test_fault_tolerant import Launch, wait_for

pytestmark = pytest.mark.multiprocess

WORKER = "tests/launcher/fault_tolerant_trackers_worker.py"
PAUSE_S = 0.1
LONG = bool(os.environ.get("MULTIGPU_LONG"))


def _steps(out: Path, group: int) -> list[dict[str, int]]:
    path = out / f"group{group}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


@pytest.mark.parametrize(
    "trackers",
    [
        ("csv", "tensorboard"),
        pytest.param(("csv", "tensorboard", "mlflow"), marks=pytest.mark.skipif(not LONG, reason="MULTIGPU_LONG=1")),
    ],
)
def test_a_restarted_main_process_continues_the_same_run_in_every_tracker(
    tmp_path: Path, trackers: tuple[str, ...]
) -> None:
    (tmp_path / "hold").touch()
    launch = Launch(
        "--strategy", "ddp", "--fault-tolerant", "--replicas", "2", "--nproc-per-node", "1", "--max-restarts", "1",
        WORKER, str(tmp_path), str(PAUSE_S), ",".join(trackers),
    )  # fmt: skip
    try:
        wait_for(lambda: len(_steps(tmp_path, 0)) >= 3, "3 logged steps of group 0", launch)
        first = _steps(tmp_path, 0)[-1]["pid"]
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: sum(s["pid"] != first for s in _steps(tmp_path, 0)) >= 2, "group 0 logging again", launch)
        (tmp_path / "total").write_text(str(max(s["global_step"] for s in _steps(tmp_path, 1)) + 2))
        (tmp_path / "hold").unlink()
        assert launch.wait(120) == 0, launch.err[-3000:]
    finally:
        launch.stop()
    assert "replica group 0: rank 0 was killed by SIGKILL; restarting it" in launch.err
    steps = _steps(tmp_path, 0)  # what group 0's two processes were about to log, in order
    (second,) = {s["pid"] for s in steps} - {first}
    before = [(s["global_step"], float(first)) for s in steps if s["pid"] == first]
    after = [(s["global_step"], float(second)) for s in steps if s["pid"] == second]
    assert before[-1][0] < after[0][0]  # healed past the last step the killed process logged

    def check(history: list[tuple[int, float]]) -> None:
        """One history of the run: each step once, in order; both processes' steps (the kill may land between
        a step's line in the worker's file and its log)."""
        assert [s for s, _ in history] == sorted({s for s, _ in history}), history
        assert [h for h in history if h[1] == first] in (before, before[:-1]), (history, before)
        assert [h for h in history if h[1] != first] == after, (history, after)

    (run,) = (tmp_path / "runs").iterdir()  # the default folder: the launch's, not each process's start time
    with (run / "metrics.csv").open() as file:
        check([(int(r["step"]), float(r["value"])) for r in csv.DictReader(file) if r["metric"] == "pid"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), purge_orphaned_data=True)
    events.Reload()
    assert len(list(run.glob("events.out.tfevents.*"))) == 2  # one file per process, in the one run folder
    check([(e.step, e.value) for e in events.Scalars("pid")])
    if "mlflow" not in trackers:
        return

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (only,) = client.search_runs([client.get_experiment_by_name("multigpu").experiment_id])  # one run, not two
    assert only.info.run_name == "ft" and only.info.status == "FINISHED"
    check(sorted((m.step, m.value) for m in client.get_metric_history(only.info.run_id, "pid")))
    record = json.loads((run / RUN_RECORD).read_text())
    assert record["trackers"]["mlflow"]["run_id"] == only.info.run_id
