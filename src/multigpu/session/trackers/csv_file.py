"""``"csv"``: ``<run_dir>/metrics.csv`` in long form, one row per value: ``step,metric,value,time``.

``time`` is seconds since the log was opened, so metrics can come and go between steps. Each row is
flushed, so a crashed run keeps every line written so far. Hyperparameters go to
``<run_dir>/hparams.json``. A run resumed from a checkpoint at step S first drops the rows of steps
after S (a crash left them; the resumed run logs them again), so each step is in the file once; a row that a
killed process left without its newline is dropped when the file is opened again (the next would join it).
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from multigpu.core.run_files import write_replacing
from multigpu.errors import ConfigError
from multigpu.session.trackers.base import RunInfo, Tracker

CSV_NAME = "metrics.csv"
HPARAMS_NAME = "hparams.json"
_HEADER = ["step", "metric", "value", "time"]


class CsvTracker(Tracker):
    name = "csv"
    allowed_options = ()

    def __init__(self, folder: Path, file: IO[str]) -> None:
        self.folder = folder
        self._file = file
        self._csv = csv.writer(file)
        self._began = time.monotonic()

    @classmethod
    def open(cls, run: RunInfo) -> CsvTracker:
        run.folder.mkdir(parents=True, exist_ok=True)
        path = run.folder / CSV_NAME
        if path.is_file() and path.stat().st_size and (run.resumed_step is not None or _cut_short(path)):
            _rewrite(path, run.resumed_step)
        fresh = not path.exists() or path.stat().st_size == 0
        file = path.open("a", newline="", encoding="utf-8")
        if fresh:
            csv.writer(file).writerow(_HEADER)
        return cls(run.folder, file)

    def log(self, values: Mapping[str, float], step: int) -> None:
        now = round(time.monotonic() - self._began, 3)
        for name, value in values.items():
            self._csv.writerow([step, name, repr(value), now])
        self._file.flush()  # a crashed run keeps every line written so far

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        path = self.folder / HPARAMS_NAME
        kept = _read_hparams(path)
        write_replacing(path, json.dumps({**kept, **hparams}, indent=1, sort_keys=True) + "\n")  # whole or not at all

    def close(self, *, failed: bool = False) -> None:
        self._file.close()


def _cut_short(path: Path) -> bool:
    """Whether the file's last row lacks its newline: a process killed while writing it (the next would join it)."""
    with path.open("rb") as file:
        file.seek(-1, os.SEEK_END)
        return file.read(1) != b"\n"


def _rewrite(path: Path, step: int | None) -> None:
    """Rewrite ``path`` without the rows of steps after ``step`` (None: keep every step) and without a last row a
    kill cut short: a new file renamed over the old one."""
    cut = _cut_short(path)
    with path.open(newline="", encoding="utf-8") as file:
        rows = list(csv.reader(file))
    if cut:
        rows = rows[:-1]
    kept = [row for row in rows[1:] if row and row[0].isdigit() and (step is None or int(row[0]) <= step)]
    if not cut and len(kept) == len(rows) - 1:
        return
    text = io.StringIO(newline="")
    csv.writer(text).writerows([_HEADER, *kept])
    write_replacing(path, text.getvalue())


def _read_hparams(path: Path) -> dict[str, Any]:
    """The hyperparameters logged so far (none when the file is missing).

    Raises:
        ConfigError: the file is not a JSON object (not one this tracker wrote), naming it and the fix.
    """
    if not path.is_file():
        return {}
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        kept = error
    if not isinstance(kept, dict):
        raise ConfigError(
            f"{path} is not the JSON object of hyperparameters this run's csv tracker writes ({kept!r:.80}); "
            "move it away or delete it, or log to another run folder (Session(run_dir=...))"
        )
    return kept
