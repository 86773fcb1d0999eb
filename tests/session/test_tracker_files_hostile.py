"""What a run folder may hold where the csv tracker and the run record write: each refused naming the file and the fix.

A folder, a named pipe or a link at ``metrics.csv``, ``hparams.json`` or ``multigpu-run.json``, JSON nested past the
parser's recursion, a CSV of another writer (another header, bytes that are not UTF-8): a ConfigError, in bounded
time (a pipe opened for appending would wait for a reader forever), and the file left as it was. A run record naming
a run id or tracker state no run of multigpu's has is refused the same way. A metric's name longer than the csv
module's field limit is the csv tracker's own row, read back; a row a kill cut inside a quoted name (one holding a
newline) is dropped as one cut before its newline is. A checkpoint's MLflow or Aim run that the store does not hold
is refused naming the store, and so is a run folder that is a file, or lies under one. A kill at any byte of the
CSV's writes leaves each step once after the next process logs (a restart of the run, or another run appending).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multigpu.checkpoint import Checkpointer
from multigpu.errors import ConfigError
from multigpu.session import Session
from multigpu.session.metrics import RUN_RECORD

pytestmark = [
    pytest.mark.timeout(30),  # a pipe opened for appending would block forever
    pytest.mark.filterwarnings("ignore:a tracker failed to close"),  # the Session closing after the refusal
]


def _record(**fields: object) -> bytes:
    record = {"run_id": "0" * 32, "run_name": "a", "run_dir": "b", "trackers": {"csv": {}}, "token": "tok", **fields}
    return json.dumps(record).encode()


HOSTILE: dict[str, Callable[[Path], object]] = {
    "a folder": lambda path: path.mkdir(),
    "a named pipe": lambda path: os.mkfifo(path),
    "a link": lambda path: path.symlink_to(path.with_name("elsewhere")),
}
CONTENTS = [
    ("metrics.csv", b"epoch,loss\n1,0.5\n"),  # another writer's CSV: not appended to, not rewritten
    ("metrics.csv", b"epoch,loss\n1,0.5\n2,0."),
    ("metrics.csv", b"step,metric,value,time\n1,v,\xff,0\n2,v"),
    ("hparams.json", b'{"a":' * 100_000),
    (RUN_RECORD, b'{"a":' * 100_000),
    (RUN_RECORD, _record(run_id="x' or '1'='1")),  # the run id reaches MLflow's search filter
    (RUN_RECORD, _record(trackers={"csv": {}, "aim": {"hash": 5}})),
]


def _log(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MULTIGPU_RUN_ID", "tok")
    with Session(strategy="single", trackers=("csv",), run_dir=folder) as session:
        session.log_hparams({"lr": 0.1})
        session.log({"v": 1.0}, 1)
        session.log_hparams({"batch": 8})


@pytest.mark.parametrize("kind", HOSTILE)
@pytest.mark.parametrize("name", ["metrics.csv", "hparams.json", RUN_RECORD])
def test_something_else_at_a_trackers_file_is_refused_naming_it(
    name: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    HOSTILE[kind](folder / name)
    with pytest.raises(ConfigError, match=rf"{name}'? is .*(move it away|delete it)"):
        _log(folder, monkeypatch)
    assert not (folder / "elsewhere").exists()  # nothing written through the link


@pytest.mark.parametrize(("name", "content"), CONTENTS)
def test_a_file_its_writer_cannot_have_written_is_refused_naming_it_and_left_as_it_was(
    name: str, content: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / name).write_bytes(content)
    with pytest.raises(ConfigError, match=rf"{name}'? is .*(move it away|delete it)"):
        _log(folder, monkeypatch)
    assert (folder / name).read_bytes() == content


def test_a_metric_name_longer_than_the_csv_modules_field_limit_reads_back_on_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "m" * 200_000  # csv.reader's default limit is 131072 characters a field
    monkeypatch.setenv("MULTIGPU_RUN_ID", "tok")
    for step in (1, 2):  # the second Session is a restart of the run: it rewrites the file from its first step on
        with Session(strategy="single", trackers=("csv",), run_dir=tmp_path) as session:
            session.log({name: float(step)}, step)
    limit = csv.field_size_limit(1 << 20)
    try:
        with (tmp_path / "metrics.csv").open(newline="") as file:
            rows = list(csv.reader(file, strict=True))
    finally:
        csv.field_size_limit(limit)
    assert [(r[0], r[1] == name, r[2]) for r in rows[1:]] == [("1", True, "1.0"), ("2", True, "2.0")]


@pytest.mark.parametrize("restart", [True, False])
def test_a_row_a_kill_cut_inside_a_quoted_name_is_dropped_not_joined_to_the_next(
    restart: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MULTIGPU_RUN_ID", "tok")
    with Session(strategy="single", trackers=("csv",), run_dir=tmp_path) as session:
        for step in (1, 2):
            session.log({"a": float(step), "two\nlines": -float(step)}, step)
    path = tmp_path / "metrics.csv"
    text = path.read_bytes()
    path.write_bytes(text[: text.rindex(b'"two\n') + 5])  # the kill came right after the newline inside the name
    monkeypatch.setenv("MULTIGPU_RUN_ID", "tok" if restart else "other")  # a restart rewrites; another run appends
    with Session(strategy="single", trackers=("csv",), run_dir=tmp_path) as session:
        session.log({"a": 3.0, "two\nlines": -3.0}, 3)
    with path.open(newline="") as file:
        rows = [tuple(row[:3]) for row in csv.reader(file, strict=True)][1:]
    assert rows == [
        ("1", "a", "1.0"),
        ("1", "two\nlines", "-1.0"),
        ("2", "a", "2.0"),
        ("3", "a", "3.0"),
        ("3", "two\nlines", "-3.0"),
    ]


@pytest.mark.multiprocess  # MLflow and Aim start processes of their own
@pytest.mark.skipif(not os.environ.get("MULTIGPU_LONG"), reason="imports for 10-20 s: MULTIGPU_LONG=1")
@pytest.mark.parametrize(
    ("tracker", "option", "says"), [("mlflow", "tracking_uri", "tracking store"), ("aim", "repo", "repository")]
)
def test_a_resumed_run_the_trackers_store_does_not_hold_is_refused_naming_it(
    tracker: str, option: str, says: str, tmp_path: Path
) -> None:
    model, checkpoints = torch.nn.Linear(2, 1), Checkpointer(folder=tmp_path / "ckpt")
    where = {"first": tmp_path / "first", "other": tmp_path / "other"}
    if tracker == "mlflow":
        where = {name: f"sqlite:///{path}.db" for name, path in where.items()}  # type: ignore[misc]
    stores = {name: {tracker: {option: str(store)}} for name, store in where.items()}
    with Session(strategy="single", trackers=(tracker,), run_dir=tmp_path, tracker_options=stores["first"]) as session:
        session.log({"v": 1.0}, 1)
        checkpoints.save(step=1, model=model)
    with pytest.raises(ConfigError, match=rf"(?i){tracker} run \w+ is not in the {says} .*other.*{option}"):
        with Session(strategy="single", trackers=(tracker,), run_dir=tmp_path, tracker_options=stores["other"]) as s:
            checkpoints.resume(model=model)
            s.log({"v": 2.0}, 2)


@pytest.mark.parametrize("tracker", ["csv", "tensorboard"])
@pytest.mark.parametrize("where", ["a file", "under a file", "a named pipe"])
def test_a_run_folder_that_cannot_be_one_is_refused_naming_it(tracker: str, where: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("mine")
    os.mkfifo(tmp_path / "pipe")
    folder = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "run", "a named pipe": tmp_path / "pipe"}
    with pytest.raises(ConfigError, match=rf"run folder '{folder[where]}' cannot be made .*Session\(run_dir="):
        with Session(strategy="single", trackers=(tracker,), run_dir=folder[where]) as session:
            session.log({"v": 1.0}, 1)
    assert (tmp_path / "file").read_text() == "mine"


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(cut=st.floats(0.0, 1.0), restart=st.booleans())
def test_a_kill_anywhere_in_a_write_leaves_each_step_once_after_the_next_log(
    cut: float, restart: bool, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path_factory.mktemp("run")
    monkeypatch.setenv("MULTIGPU_RUN_ID", "tok")
    with Session(strategy="single", trackers=("csv",), run_dir=folder) as session:
        for step in (1, 2, 3):
            session.log({"a": float(step), 'q"\n': -float(step)}, step)
    path = folder / "metrics.csv"
    text = path.read_bytes()
    path.write_bytes(text[: int(cut * len(text))])  # what a SIGKILL inside the writes leaves
    monkeypatch.setenv("MULTIGPU_RUN_ID", "tok" if restart else "other")
    with Session(strategy="single", trackers=("csv",), run_dir=folder) as session:
        session.log({"a": 9.0, 'q"\n': 9.0}, 3 if restart else 4)
    with path.open(newline="") as file:
        rows = list(csv.reader(file, strict=True))
    assert rows[0] == ["step", "metric", "value", "time"] and all(len(row) == 4 for row in rows[1:])
    keys = [tuple(row[:2]) for row in rows[1:]]
    assert len(keys) == len(set(keys)) and {row[2] for row in rows[1:] if row[0] == str(3 if restart else 4)} == {"9.0"}


def test_hparams_logged_at_once_by_many_writers_keep_every_key(tmp_path: Path) -> None:
    # each writer reads hparams.json, adds its keys and replaces the file: without a lock held from the read to the
    # rename, one writer's rename dropped the keys another wrote in between (two runs, or threads, in one folder)
    import threading

    from multigpu.session.trackers.base import RunInfo
    from multigpu.session.trackers.csv_file import CsvTracker

    trackers = [CsvTracker.open(RunInfo(folder=tmp_path, name="a", run_id="0" * 32)) for _ in range(4)]
    start = threading.Barrier(len(trackers))

    def write(i: int) -> None:
        start.wait()
        for k in range(40):
            trackers[i].log_hparams({f"w{i}-{k}": k})

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(trackers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for tracker in trackers:
        tracker.close()
    assert len(json.loads((tmp_path / "hparams.json").read_text())) == 4 * 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hparams.json", "metrics.csv"]  # no partial, no lock file


def test_an_int_hyperparameter_no_tracker_can_write_as_text_is_refused_at_the_call(tmp_path: Path) -> None:
    # 10**5000 passed the check (an int) and was kept for the trackers; json cannot write an int of more than
    # sys.get_int_max_str_digits() digits, so the first log opened the trackers and raised ValueError, and so did
    # every log after it: the run logged nothing more
    with Session(strategy="single", trackers=("csv",), run_dir=tmp_path) as session:
        with pytest.raises(
            ConfigError, match=r"hyperparameter 'seed' is an int of more than \d+ digits; log it as a str"
        ):
            session.log_hparams({"seed": 10**5000})
        session.log_hparams({"lr": 0.1})
        session.log({"v": 1.0}, 1)
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"lr": 0.1}


def test_a_partial_left_by_a_writer_killed_while_holding_its_turn_is_removed_by_the_next(tmp_path: Path) -> None:
    # a writer SIGKILLed between writing its partial and renaming it over hparams.json left the partial in the
    # run folder for good; the next writer, holding the folder's turn, knows no other writer is inside one
    from multigpu.session.trackers.base import RunInfo
    from multigpu.session.trackers.csv_file import CsvTracker

    stale = tmp_path / "hparams.json.999999.1.tmp"
    stale.write_text('{"half": ')
    other = tmp_path / "hparams.json.notes.tmp"  # not a partial's name: the user's, kept
    other.write_text("mine")
    tracker = CsvTracker.open(RunInfo(folder=tmp_path, name="a", run_id="0" * 32))
    tracker.log_hparams({"lr": 0.1})
    tracker.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hparams.json", "hparams.json.notes.tmp", "metrics.csv"]
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"lr": 0.1}
