"""What a run reports: metrics written once to the run folder, a progress bar, and where this process stands."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.session import Session


def _rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "metrics.csv").open() as file:
        return list(csv.DictReader(file))


def test_log_appends_one_row_per_metric_to_the_run_folder(tmp_path: Path) -> None:
    with Session(strategy="single", run_dir=tmp_path / "run") as session:
        assert session.run_dir == tmp_path / "run"
        session.log({"loss": torch.tensor(0.5), "lr": 0.1}, step=1)
        session.log({"loss": 0.25}, step=2)
    rows = _rows(tmp_path / "run")
    assert [(r["step"], r["metric"], float(r["value"])) for r in rows] == [
        ("1", "loss", 0.5),
        ("1", "lr", 0.1),
        ("2", "loss", 0.25),
    ]
    with Session(strategy="single", run_dir=tmp_path / "run") as session:  # a second run appends, one header
        session.log({"loss": 0.125}, step=3)
    assert [r["step"] for r in _rows(tmp_path / "run")] == ["1", "1", "2", "3"]


def test_the_default_run_folder_is_named_by_time_and_strategy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with Session(strategy="single") as session:
        session.log({"loss": 1.0}, step=0)
        folder = session.run_dir
    assert folder.parent == Path("runs") and folder.name.endswith("-single")
    assert (tmp_path / folder / "metrics.csv").is_file()


@pytest.mark.parametrize(
    ("metrics", "step", "says"),
    [
        ({"loss": torch.ones(3)}, 1, r"metric 'loss' is a Tensor, not one number"),
        ({"loss": "low"}, 1, r"metric 'loss' is a str"),
        ({3: 1.0}, 1, r"metric name 3 must be a string"),
        ([("loss", 1.0)], 1, r"takes a mapping of name -> value, got list"),
        ({"loss": 1.0}, -1, r"step=-1 must be an integer >= 0"),
        ({"loss": 1.0}, 1.5, r"step=1\.5 must be an integer >= 0"),
    ],
)
def test_log_refuses_what_is_not_a_scalar_metric(tmp_path: Path, metrics: Any, step: Any, says: str) -> None:
    with Session(strategy="single", run_dir=tmp_path) as session:
        with pytest.raises(ConfigError, match=says):
            session.log(metrics, step)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_log_writes_tensorboard_events_when_installed(tmp_path: Path) -> None:
    with Session(strategy="single", run_dir=tmp_path) as session:
        session.log({"loss": 0.5}, step=1)
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_a_progress_bar_counts_the_batches(capsys: pytest.CaptureFixture[str]) -> None:
    with Session(strategy="single") as session:
        seen = list(session.batches([torch.zeros(1)] * 3, progress=True, description="epoch 0"))
    assert len(seen) == 3
    out = capsys.readouterr().out
    assert "epoch 0" in out and "3/3" in out


def test_one_process_is_rank_zero_on_every_count() -> None:
    with Session(strategy="single") as session:
        assert (session.rank, session.global_rank, session.local_rank, session.world_size) == (0, 0, 0, 1)
