"""A launch's run token (``MULTIGPU_RUN_ID``) keeps one tracker run over the processes of one launch.

Each test runs Sessions in this process, one after another, as a restarted main process would: with the same
token the second continues the first's run in every tracker (read back through the tracker's own reader); with
another token it starts a run of its own. W&B runs them in a process of its own (its service leaves threads
and a variable in the process that ran it). W&B and Aim take 10-20 s to import on a loaded machine: with
MULTIGPU_LONG=1.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import multigpu
from multigpu.cli.main import main
from multigpu.errors import ConfigError, LaunchError
from multigpu.runtime.worker_env import WorkerEnv, new_run_token
from multigpu.session import Session
from multigpu.session.metrics import RUN_RECORD, run_id_of
from tests.launching import run_command, run_together

LONG = bool(os.environ.get("MULTIGPU_LONG"))
Steps = dict[str, list[tuple[int, float]]]  # each run the tracker's store holds: its (step, value) pairs


def _csv(tmp_path: Path) -> Steps:
    runs = {}
    for folder in sorted((tmp_path / "runs").iterdir()):
        with (folder / "metrics.csv").open() as file:
            runs[folder.name] = [
                (int(r["step"]), float(r["value"])) for r in csv.DictReader(file) if r["metric"] == "v"
            ]
    return runs


def _tensorboard(tmp_path: Path) -> Steps:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {}
    for folder in sorted((tmp_path / "runs").iterdir()):
        events = EventAccumulator(str(folder), purge_orphaned_data=True)
        events.Reload()
        runs[folder.name] = [(e.step, e.value) for e in events.Scalars("v")]
    return runs


def _mlflow(tmp_path: Path) -> Steps:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = client.search_runs([client.get_experiment_by_name("multigpu").experiment_id])
    return {
        r.info.run_id: sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, "v")) for r in found
    }


def _trackio(tmp_path: Path) -> Steps:
    from trackio.sqlite_storage import SQLiteStorage

    return {
        name: [(int(row["step"]), float(row["v"])) for row in SQLiteStorage.get_logs("multigpu", name) if "v" in row]
        for name in SQLiteStorage.get_runs("multigpu")
    }


def _wandb_folders(tmp_path: Path) -> dict[str, int]:
    """How many offline folders each W&B run id has: each process of a run writes one, offline-run-<time>-<id>[-n]."""
    runs: dict[str, int] = {}
    for folder in sorted((tmp_path / "wandb").glob("offline-run-*")):
        run_id = re.fullmatch(r"offline-run-[0-9_]+-([0-9a-z]+)(-[0-9]+)?", folder.name)
        assert run_id is not None, folder.name
        runs[run_id[1]] = runs.get(run_id[1], 0) + 1
    return runs


def _aim(tmp_path: Path) -> Steps:
    """The runs the run folders name, read by hash (Aim's listing of a repository lags behind a run just closed)."""
    from aim import Repo, Run

    repo, runs = Repo.from_path(str(tmp_path / "aim")), {}
    for record in sorted((tmp_path / "runs").glob(f"*/{RUN_RECORD}")):
        run_hash = json.loads(record.read_text())["trackers"]["aim"]["hash"]
        run = Run(run_hash, repo=repo)
        (metric,) = [m for m in run.metrics() if m.name == "v"]
        steps, values = metric.data.items_list()
        runs[run_hash] = [(s, float(v)) for s, v in zip(steps, values[0])]
        run.close()
    return runs


READERS: dict[str, Callable[[Path], Steps]] = {
    "csv": _csv,
    "tensorboard": _tensorboard,
    "mlflow": _mlflow,
    "trackio": _trackio,
    "aim": _aim,
}
SLOW = pytest.mark.skipif(not LONG, reason="imports for 10-20 s on a loaded machine: MULTIGPU_LONG=1")
STARTS = pytest.mark.multiprocess  # the library starts a process of its own (W&B's service; MLflow's, Aim's helpers)


@pytest.fixture
def stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> dict[str, dict[str, Any]]:
    """Every tracker's store under ``tmp_path`` (trackio reads TRACKIO_DIR once, at its import: set it there)."""
    monkeypatch.chdir(tmp_path)  # the default run folder, runs/<token>
    if getattr(request.node, "callspec", None) and request.node.callspec.params.get("tracker") == "trackio":
        import trackio.sqlite_storage
        import trackio.utils

        for module in (trackio.utils, trackio.sqlite_storage):
            monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    return {
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "aim": {"repo": str(tmp_path / "aim")},
    }


def _log(monkeypatch: pytest.MonkeyPatch, token: str, tracker: str, options: Any, steps: range, **fields: Any) -> Path:
    monkeypatch.setenv("MULTIGPU_RUN_ID", token)
    options = {k: v for k, v in options.items() if k == tracker}
    with Session(strategy="single", trackers=(tracker,), run_name="tok", tracker_options=options, **fields) as session:
        for step in steps:
            session.log({"v": float(step) + 0.5 * (token == "second")}, step)
        return session.run_dir


@pytest.mark.parametrize(
    "tracker",
    [
        "csv",
        "tensorboard",
        pytest.param("mlflow", marks=STARTS),
        "trackio",
        pytest.param("aim", marks=[SLOW, STARTS]),
    ],
)
def test_two_sessions_of_one_token_continue_one_run_and_another_token_starts_another(
    tracker: str, stores: dict[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _log(monkeypatch, "first", tracker, stores, range(1, 4))
    assert first == Path("runs") / "first"  # the token's folder, whatever time each process started
    _log(monkeypatch, "first", tracker, stores, range(4, 6))  # a restarted main process: the same run
    _log(monkeypatch, "second", tracker, stores, range(1, 3))  # another launch: a run of its own
    runs = READERS[tracker](tmp_path)
    assert sorted(runs.values()) == [[(s, float(s)) for s in range(1, 6)], [(1, 1.5), (2, 2.5)]], runs


_WANDB_SESSIONS = """
import os, sys
from multigpu.session import Session
os.chdir(sys.argv[1])
for token, run_dir, steps in [("first", None, (1, 2)), ("first", None, (3,)), ("second", None, (1,)),
                              ("first", "elsewhere/a", (4,))]:
    os.environ["MULTIGPU_RUN_ID"] = token
    where = {"dir": "elsewhere"} if run_dir else {}
    with Session(strategy="single", trackers=("wandb",), run_dir=run_dir, tracker_options={"wandb": where}) as s:
        for step in steps:
            s.log({"v": float(step)}, step)
"""


@SLOW
@STARTS
def test_wandb_continues_the_run_of_the_tokens_id_with_or_without_the_run_folder(tmp_path: Path) -> None:
    """In a process of its own: W&B's service leaves threads and a variable in the process that ran it."""
    (tmp_path / "elsewhere").mkdir()
    done = run_command([sys.executable, "-c", _WANDB_SESSIONS, str(tmp_path)], timeout_s=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _wandb_folders(tmp_path) == {run_id_of("first"): 2, run_id_of("second"): 1}  # W&B's id: the token's
    assert _wandb_folders(tmp_path / "elsewhere") == {run_id_of("first"): 1}  # no run record there: the id alone


@pytest.mark.parametrize("tracker", [pytest.param("mlflow", marks=STARTS), "trackio"])
def test_without_the_run_folder_the_trackers_store_finds_the_run_by_its_token(
    tracker: str, stores: dict[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relaunch joined to the run from elsewhere (its own run_dir, so no run record): the library finds it."""
    _log(monkeypatch, "first", tracker, stores, range(1, 3), run_dir=tmp_path / "a")
    _log(monkeypatch, "first", tracker, stores, range(3, 5), run_dir=tmp_path / "b")
    runs = READERS[tracker](tmp_path)
    assert list(runs.values()) == [[(s, float(s)) for s in range(1, 5)]]


def test_a_restarted_process_logs_again_from_its_first_step_and_each_step_stays_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart before any checkpoint starts from step 1 again: what the killed process logged is replaced."""
    monkeypatch.chdir(tmp_path)
    _log(monkeypatch, "first", "csv", {}, range(1, 6))
    _log(monkeypatch, "first", "tensorboard", {}, range(1, 6))
    monkeypatch.setenv("MULTIGPU_RUN_ID", "first")
    with Session(strategy="single", trackers=("csv", "tensorboard"), run_name="tok") as session:
        for step in (2, 3):
            session.log({"v": 10.0 * step}, step)
    expected = [(1, 1.0), (2, 20.0), (3, 30.0)]
    assert _csv(tmp_path) == {"first": expected}
    assert _tensorboard(tmp_path) == {"first": expected}
    record = json.loads((tmp_path / "runs" / "first" / RUN_RECORD).read_text())
    assert record["run_id"] == run_id_of("first") and set(record["trackers"]) == {"csv", "tensorboard"}


def test_a_session_without_a_token_keeps_a_run_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MULTIGPU_RUN_ID", raising=False)
    for _ in range(2):
        with Session(strategy="single", trackers=("csv",), run_dir=tmp_path / "mine") as session:
            session.log({"v": 1.0}, 1)
    assert _csv_rows(tmp_path / "mine") == [(1, 1.0), (1, 1.0)]  # appended, as before tokens: no rewind
    assert not (tmp_path / "mine" / RUN_RECORD).exists()


def _csv_rows(folder: Path) -> list[tuple[int, float]]:
    with (folder / "metrics.csv").open() as file:
        return [(int(r["step"]), float(r["value"])) for r in csv.DictReader(file) if r["metric"] == "v"]


@pytest.mark.parametrize("token", ["a b", "x" * 65, "-leading", "../up", "tab\there", "ü", "semi;colon", "quote'd"])
def test_a_bad_token_is_refused_naming_the_value_and_the_fix(token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LaunchError, match=r"MULTIGPU_RUN_ID=.* is not a run token: 1 to 64 letters.*unset it"):
        WorkerEnv.from_environ({"MULTIGPU_RUN_ID": token})
    with pytest.raises(ConfigError, match=r"WorkerEnv: MULTIGPU_RUN_ID=.* is not a run token"):
        WorkerEnv(run_token=token)
    monkeypatch.setenv("MULTIGPU_RUN_ID", token)
    with pytest.raises(LaunchError, match=r"is not a run token"), Session(strategy="single") as session:
        session.log({"v": 1.0}, 1)


def test_a_good_token_and_a_new_one_read_back_as_written() -> None:
    for token in ("a", "x" * 64, "Run_1.2-3", new_run_token()):
        assert WorkerEnv.from_environ(WorkerEnv(run_token=token).to_environ()).run_token == token
    assert new_run_token() != new_run_token()


def test_multigpu_launch_refuses_a_bad_exported_token_before_it_starts_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never runs')\n")
    monkeypatch.setenv("MULTIGPU_RUN_ID", "my run")
    assert main(["launch", "--strategy", "single", str(script)]) == 2
    assert "MULTIGPU_RUN_ID='my run' is not a run token" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_multigpu_launch_passes_the_users_token_or_a_new_one_to_its_workers(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('token', os.environ['MULTIGPU_RUN_ID'])\n")
    argv = [sys.executable, "-m", "multigpu", "launch", "--strategy", "single", str(script)]
    mine, new = run_together([argv, argv], timeout_s=120, envs=[{"MULTIGPU_RUN_ID": "digits-lr0.1"}, {}])
    assert mine.returncode == 0 and new.returncode == 0, mine.stderr[-2000:] + new.stderr[-2000:]
    assert "token digits-lr0.1" in mine.stdout
    (made,) = [line.split()[1] for line in new.stdout.splitlines() if line.startswith("token ")]
    assert made != "digits-lr0.1" and WorkerEnv.from_environ({"MULTIGPU_RUN_ID": made}).run_token == made


def test_a_checkpoints_saved_runs_win_over_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model, checkpoints = torch.nn.Linear(2, 1), multigpu.Checkpointer(folder=tmp_path / "ckpt")
    monkeypatch.setenv("MULTIGPU_RUN_ID", "first")
    with Session(strategy="single", trackers=("csv",)) as session:
        session.log({"v": 1.0}, 1)
        checkpoints.save(step=1, model=model)
        session.log({"v": 2.0}, 2)  # after the save: the resumed run logs it again
    monkeypatch.setenv("MULTIGPU_RUN_ID", "second")  # a relaunch: a launch, and a token, of its own
    with Session(strategy="single", trackers=("csv",)) as session:
        resumed = checkpoints.resume(model=model)
        assert resumed is not None and resumed.step == 1
        session.log({"v": 20.0}, 2)
    assert _csv(tmp_path) == {"first": [(1, 1.0), (2, 20.0)]}  # the saved run, rewound to the checkpoint
    record = json.loads((tmp_path / "runs" / "first" / RUN_RECORD).read_text())
    assert record["token"] == "second" and record["run_id"] == run_id_of("first")


@pytest.mark.parametrize("damage", [b"{not json", b'{"run_id": 3}', b"[]"])
def test_a_damaged_run_record_is_refused_naming_the_file_and_the_fix(
    damage: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _log(monkeypatch, "first", "csv", {}, range(1, 2))
    (tmp_path / "runs" / "first" / RUN_RECORD).write_bytes(damage)
    with pytest.raises(ConfigError, match=r"multigpu-run.json' is not the run record multigpu writes.*delete it"):
        _log(monkeypatch, "first", "csv", {}, range(2, 3))
    assert _csv(tmp_path) == {"first": [(1, 1.0)]}  # nothing written


def test_a_csv_row_a_kill_cut_short_is_dropped_not_joined_to_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _log(monkeypatch, "first", "csv", {}, range(1, 3))
    with (tmp_path / "runs" / "first" / "metrics.csv").open("a") as file:
        file.write("3,v,3.")  # what a SIGKILL in the middle of a write leaves
    monkeypatch.setenv("MULTIGPU_RUN_ID", "other")  # not even a restart of the run: appending alone must not join it
    with Session(strategy="single", trackers=("csv",), run_dir=tmp_path / "runs" / "first") as session:
        session.log({"v": 4.0}, 4)
    assert _csv(tmp_path) == {"first": [(1, 1.0), (2, 2.0), (4, 4.0)]}
