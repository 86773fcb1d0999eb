"""Experiment trackers behind ``session.log``: chosen by name, one run across pre-emption and relaunch.

The end-to-end test runs one 2-rank ddp job three times (pre-empted; relaunched, resumed and SIGKILLed;
restarted by torchrun from the older checkpoint, raising after its last step) with all six trackers and no
tracker code in the worker beyond ``Session(trackers=...)`` (the Checkpointer carries the runs' identity), and reads
every history back through the tracker's own reader: the csv module, TensorBoard's event accumulator,
the MLflow client, W&B's ``wandb leet inspect`` of its offline files, Aim's repository, trackio's
local store.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import multigpu
from multigpu.errors import CheckpointError, ConfigError
from multigpu.session import Session
from multigpu.session.trackers import Tracker
from tests.launching import ROOT, run_command, run_together

WORKER = ROOT / "tests" / "session" / "trackers_worker.py"


def _csv_steps(folder: Path, metric: str = "launch") -> list[tuple[int, float]]:
    with (folder / "metrics.csv").open() as file:
        return [(int(r["step"]), float(r["value"])) for r in csv.DictReader(file) if r["metric"] == metric]


def _board_steps(folder: Path, metric: str = "launch") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), purge_orphaned_data=True)
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(metric)]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"trackers": ("csv", "comet")}, r"'comet' is not one of \['aim', 'csv', 'mlflow', 'tensorboard'"),
        ({"trackers": "csv"}, r"trackers='csv' must be a tuple of tracker names"),
        ({"trackers": ("csv", "csv")}, r"names a tracker twice"),
        ({"trackers": ("csv",), "tracker_options": {"wandb": {}}}, r"tracker_options has 'wandb', which is not in"),
        ({"trackers": ("wandb",), "tracker_options": {"wandb": {"id": "x"}}}, r"sets \['id'\], which multigpu"),
        ({"trackers": ("csv",), "tracker_options": {"csv": 3}}, r"must map a tracker's name to its keywords"),
        (
            {"trackers": ("csv",), "tracker_options": {"csv": {"sep": ";"}}},
            r"has \['sep'\]; the 'csv' tracker takes no",
        ),
        (
            {"trackers": ("mlflow",), "tracker_options": {"mlflow": {"uri": "x"}}},
            r"takes \['tracking_uri', 'experiment'",
        ),
        ({"trackers": ("tensorboard",), "tracker_options": {"tensorboard": {"log_dir": "x"}}}, r"sets \['log_dir'\]"),
        ({"run_name": ""}, r"run_name='' must be a non-empty string"),
    ],
)
def test_tracker_choices_are_checked_where_they_are_written(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        Session(strategy="single", **fields)


def test_a_tracker_whose_library_is_missing_names_its_extra() -> None:
    class Absent(Tracker):  # a tracker of a library that is not installed anywhere
        name = "absent"
        modules: ClassVar[tuple[str, ...]] = ("multigpu_no_such_tracker_library",)
        extra = "absent"

    with pytest.raises(
        ConfigError, match=r"tracker 'absent' needs multigpu_no_such_tracker_library.*'multigpu\[absent\]'"
    ):
        Absent.check_installed()


@pytest.mark.parametrize(
    ("hparams", "says"),
    [
        ([("lr", 0.1)], r"takes a mapping of name -> value, got list"),
        ({1: 0.1}, r"hyperparameter name 1 must be a string"),
        ({"layers": [1, 2]}, r"hyperparameter 'layers' is a list; .*flatten nested settings"),
    ],
)
def test_log_hparams_refuses_what_trackers_cannot_hold(tmp_path: Path, hparams: Any, says: str) -> None:
    with Session(strategy="single", run_dir=tmp_path, trackers=("csv",)) as session:
        with pytest.raises(ConfigError, match=says):
            session.log_hparams(hparams)


@pytest.mark.parametrize("found", [b'{"lr": 0.1', b"[1, 2]", b"\xff\xfe"])
def test_hparams_merge_into_the_file_whole_and_a_file_that_is_not_theirs_is_refused_naming_it(
    tmp_path: Path, found: bytes
) -> None:
    with Session(strategy="single", run_dir=tmp_path / "ok", trackers=("csv",)) as session:
        session.log_hparams({"lr": 0.1})
        session.log({"loss": 1.0}, 0)
        session.log_hparams({"batch": 8})
    assert json.loads((tmp_path / "ok" / "hparams.json").read_text()) == {"lr": 0.1, "batch": 8}
    assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == ["hparams.json", "metrics.csv"]  # no partial left
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "hparams.json").write_bytes(found)  # a kill could not leave this: another writer's file
    with pytest.raises(ConfigError, match=r"hparams.json is not the JSON object .* delete it"):
        with Session(strategy="single", run_dir=tmp_path / "bad", trackers=("csv",)) as session:
            session.log({"loss": 1.0}, 0)
            session.log_hparams({"lr": 0.1})
    assert (tmp_path / "bad" / "hparams.json").read_bytes() == found  # left as it was


def test_a_checkpoint_carries_the_tracker_runs_and_a_resume_continues_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No code of the user's: each launch starts elsewhere, without run_dir, and still logs into the first folder."""
    model, checkpoints = torch.nn.Linear(2, 1), multigpu.Checkpointer(folder=tmp_path / "ckpt", keep_last=None)
    checkpoints.save(step=0, model=model, extra={"mine": 0})  # no Session: no tracker runs to save
    assert torch.load(tmp_path / "ckpt" / "step-00000000" / "state.pt")["extra"] == {"mine": 0}
    for launch in (1, 2, 3):
        (tmp_path / f"cwd{launch}").mkdir()
        monkeypatch.chdir(tmp_path / f"cwd{launch}")  # the default run folder, runs/<time>-single, would go here
        with Session(strategy="single", trackers=("csv", "tensorboard"), run_name="r") as session:
            session.log_hparams({"lr": 0.1, "launch": launch})  # before the resume: waits for the trackers to open
            resumed = checkpoints.resume(model=model)
            assert resumed is not None and resumed.extra == {"mine": launch - 1}  # the identity is not the user's
            if launch == 1:
                first_folder = session.run_dir.resolve()
            elif launch == 2:  # resumed from step 3, and saved again before its first log: still the same runs
                checkpoints.save(step=4, model=model, extra={"mine": 2})
            assert session.run_dir.resolve() == first_folder
            for step in range(resumed.step + 1, resumed.step + 4):  # launch 1 logs 4 and 5 after its last save
                session.log({"launch": launch}, step)
                if launch == 1 and step == 3:
                    checkpoints.save(step=3, model=model, extra={"mine": 1})
    assert not (tmp_path / "cwd2" / "runs").exists() and not (tmp_path / "cwd3" / "runs").exists()
    expected = [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 3.0), (6, 3.0), (7, 3.0)]
    assert _csv_steps(first_folder) == expected  # steps 4 and 5 of launch 1, and 5, 6 of launch 2: rewound
    assert _board_steps(first_folder) == expected
    assert json.loads((first_folder / "hparams.json").read_text()) == {"lr": 0.1, "launch": 3}
    saved = torch.load(tmp_path / "ckpt" / "step-00000004" / "state.pt")["extra"]["multigpu.trackers"]
    assert saved["run_dir"] == str(first_folder) and saved["run_name"] == "r"
    assert multigpu.Checkpointer(folder=tmp_path / "ckpt").resume(model=model).extra == {"mine": 2}  # no Session


def test_the_saved_tracker_runs_are_refused_where_they_do_not_fit(tmp_path: Path) -> None:
    model, checkpoints = torch.nn.Linear(2, 1), multigpu.Checkpointer(folder=tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"extra has the key 'multigpu.trackers', which the Checkpointer fills"):
        checkpoints.save(step=1, model=model, extra={"multigpu.trackers": {}})
    with Session(strategy="single", run_dir=tmp_path / "run", trackers=("csv",)) as session:
        session.log({"loss": 1.0}, 1)
        state_file = checkpoints.save(step=1, model=model) / "state.pt"
    state = torch.load(state_file)
    state["extra"]["multigpu.trackers"] = {"run_id": 3}  # damaged
    torch.save(state, state_file)
    with torch.no_grad():
        model.weight.add_(1.0)
    changed = [p.clone() for p in model.parameters()]
    with Session(strategy="single", run_dir=tmp_path / "run", trackers=("csv",)):
        with pytest.raises(
            CheckpointError, match=r"entry 'extra'\['multigpu.trackers'\] is \{'run_id': 3\}.*Nothing was loaded"
        ):
            checkpoints.resume(model=model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), changed))  # nothing was loaded
    assert checkpoints.resume(model=model) is not None  # without a Session, nothing asks for the trackers' runs


def test_a_log_before_the_resume_opens_new_runs_then_the_saved_ones_continue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    model, checkpoints = torch.nn.Linear(2, 1), multigpu.Checkpointer(folder=tmp_path / "ckpt")
    with Session(strategy="single", run_dir=tmp_path / "first", trackers=("csv",)) as session:
        session.log({"launch": 1}, 1)
        checkpoints.save(step=1, model=model)
    session = Session(strategy="single", trackers=("csv",))
    with session:
        session.log({"launch": 2}, 0)  # opens a new run (a new folder) before the resume
        stray = session.run_dir
        with pytest.warns(RuntimeWarning, match=r"session.log came before Checkpointer.resume.*resume before the"):
            checkpoints.resume(model=model)
        session.log({"launch": 2}, 2)
    assert _csv_steps(tmp_path / "first") == [(1, 1.0), (2, 2.0)]
    assert _csv_steps(stray) == [(0, 2.0)]
    with pytest.raises(ConfigError, match=r"the session has not started"):  # closed: no new tracker run opens
        session.log({"launch": 3}, 3)
    assert _csv_steps(tmp_path / "first") == [(1, 1.0), (2, 2.0)]


def _launch(tmp_path: Path, *args: str, restarts: int = 0) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "multigpu", "launch", "--strategy", "ddp", "--nproc-per-node", "2"]
    env = {"TRACKIO_DIR": str(tmp_path / "trackio"), "OMP_NUM_THREADS": "1"}
    argv += ["--max-restarts", str(restarts), str(WORKER), str(tmp_path), *args]
    return run_command(argv, timeout_s=360, env=env)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_every_tracker_keeps_one_run_across_preemption_crash_and_relaunch(tmp_path: Path) -> None:
    first = _launch(tmp_path, "1", "12", "preempt-at", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    stopped = {int(line.split()[2]) for line in first.stdout.splitlines() if line.startswith("stopped ")}
    assert len(stopped) == 1, first.stdout[-2000:]  # both ranks stopped at one agreed step, and saved it
    stop = stopped.pop()
    # rank 0 is SIGKILLed 5 steps on (the last checkpoint: a multiple of 3 before); torchrun restarts both
    # ranks, which resume from that older checkpoint, then raise after their last step
    second = _launch(tmp_path, "2", "12", "crash-at", str(stop + 5), "raise-at", "12", restarts=1)
    assert second.returncode != 0 and "diverged at step 12" in second.stderr, second.stderr[-3000:]
    last_save = (stop + 4) // 3 * 3

    # which launch's value each step holds when the re-logged steps replace the crashed run's
    launch_of = {s: 1 if s <= stop else 2 if s <= last_save else 3 for s in range(1, 13)}
    replaced = [(s, float(launch_of[s])) for s in range(1, 13)]
    relogged = range(last_save + 1, stop + 6)  # logged by the crashed attempt, then again by the restarted one
    (run_dir,) = (tmp_path / "runs").iterdir()  # one folder over the three attempts
    assert _csv_steps(run_dir) == replaced
    assert _board_steps(run_dir) == replaced
    # the readers that are programs of their own run side by side; MLflow's client meanwhile, here
    wandb_logs = [next(f.glob("run-*.wandb")) for f in sorted((tmp_path / "wandb").glob("offline-run-*"))]
    assert len(wandb_logs) == 3 and len({log.parent.name.rsplit("-", 1)[1] for log in wandb_logs}) == 1  # one id
    aim = [str(Path(sys.executable).parent / "aim"), "storage", "--repo", str(tmp_path / "aim"), "reindex", "--yes"]
    trackio = (
        "import json\nfrom trackio.sqlite_storage import SQLiteStorage as S\n"
        "runs = S.get_runs('multigpu')\nprint(json.dumps([runs, S.get_logs('multigpu', runs[0])]))"
    )
    commands = [aim, [sys.executable, "-c", trackio], *([*_WANDB_INSPECT, str(log)] for log in wandb_logs)]
    with ThreadPoolExecutor(1) as pool:
        readers = pool.submit(run_together, commands, timeout_s=240, env={"TRACKIO_DIR": str(tmp_path / "trackio")})
        _check_mlflow(tmp_path, launch_of, relogged)
        reindexed, trackio_read, *inspected = readers.result()
    assert reindexed.returncode == 0, reindexed.stderr[-2000:]  # what `aim up` does before it shows runs
    _check_aim(tmp_path, replaced)
    _check_wandb([_wandb_records(done) for done in inspected], stop, last_save)
    _check_trackio(trackio_read, launch_of, stop, last_save)


def _check_mlflow(tmp_path: Path, launch_of: dict[int, int], relogged: range) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("multigpu").experiment_id])
    assert run.info.run_name == "trk" and run.info.status == "FAILED"  # the last attempt raised
    assert run.data.params == {"lr": "0.1", "batch": "8"}
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "launch")]
    # append-only: the steps the crashed attempt logged after its checkpoint are there twice, the resumed value last
    assert Counter(s for s, _ in history) == Counter({s: 2 if s in relogged else 1 for s in range(1, 13)})
    latest = {s: v for s, v in sorted(history, key=lambda sv: sv[0])}
    assert latest == {s: float(launch_of[s]) for s in range(1, 13)}


def _check_aim(tmp_path: Path, replaced: list[tuple[int, float]]) -> None:
    from aim import Repo

    (run,) = list(Repo(str(tmp_path / "aim")).iter_runs())
    assert run.name == "trk" and run["hparams"] == {"lr": 0.1, "batch": 8}
    (launch,) = [m for m in run.metrics() if m.name == "launch"]
    steps, values = launch.data.items_list()
    assert list(zip(steps, [float(v) for v in values[0]])) == replaced  # one value per step: the resumed run's


def _check_wandb(launches: list[list[dict[str, Any]]], stop: int, last_save: int) -> None:
    """``launches``: the records of each attempt's offline file, in the order they ran."""
    first, crashed, final = (
        [(int(r["history"]["item"]["_step"]), r["history"]["item"]["launch"]) for r in records if "history" in r]
        for records in launches
    )
    assert first == [(s, 1) for s in range(1, stop + 1)]  # pre-emption: closed cleanly, every step once
    assert set(crashed) <= {(s, 2) for s in range(stop + 1, stop + 6)}  # a SIGKILL loses what W&B had not written
    assert final == [(s, 3) for s in range(last_save + 1, 13)]
    exits = [[r["exit"]["exit_code"] for r in records if r.get("type") == "exit"] for records in launches]
    assert exits == [[0], [], [1]]  # closed cleanly; killed; raised


def _check_trackio(
    done: subprocess.CompletedProcess[str], launch_of: dict[int, int], stop: int, last_save: int
) -> None:
    assert done.returncode == 0, done.stderr[-2000:]
    runs, logs = json.loads(done.stdout.strip().splitlines()[-1])
    (name,) = runs
    assert name.startswith("trk-") and len(name) == len("trk-") + 8  # its name and 8 hex digits of its id: unique
    history = [(int(row["step"]), row["launch"]) for row in logs if "launch" in row]
    counts = Counter(s for s, _ in history)
    assert all(counts[s] == 1 for s in range(1, stop + 1)) and all(counts[s] == 1 for s in range(stop + 6, 13))
    assert all(counts[s] <= 2 for s in range(1, 13))  # re-logged steps appended again (a crash may lose its last rows)
    last = {s: v for s, v in history}
    assert all(last[s] == 3 for s in range(last_save + 1, 13)) and all(
        last[s] == launch_of[s] for s in range(1, stop + 1)
    )


_WANDB_INSPECT = [sys.executable, "-m", "wandb", "leet", "inspect", "--json"]  # W&B's own reader of its files


def _wandb_records(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """The records of a W&B offline run file, as ``wandb leet inspect --json`` printed them."""
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


class _CloseFails(Tracker):
    """A tracker whose store went away: its close raises (a full disk, a dropped database)."""

    name = "close-fails"

    @classmethod
    def open(cls, run: Any) -> _CloseFails:
        return cls()

    def log(self, values: Any, step: int) -> None:
        pass

    def close(self, *, failed: bool = False) -> None:
        raise OSError("the tracker's store is gone")


def test_a_tracker_that_fails_to_close_still_lets_the_session_and_the_others_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from multigpu.session.trackers import registry

    monkeypatch.setitem(registry.TRACKERS, "close-fails", _CloseFails)
    session = Session(strategy="single", run_dir=tmp_path, trackers=("close-fails", "csv"))
    with pytest.raises(OSError, match="store is gone"):
        with session:
            session.log({"launch": 1}, 1)
    assert session.strategy is None  # left the group all the same
    assert _csv_steps(tmp_path) == [(1, 1.0)]
    with pytest.warns(RuntimeWarning, match=r"a tracker failed to close: OSError"):
        with pytest.raises(ValueError, match="the loop's own error"):
            with Session(strategy="single", run_dir=tmp_path, trackers=("close-fails",)) as session:
                session.log({"launch": 2}, 2)
                raise ValueError("the loop's own error")
