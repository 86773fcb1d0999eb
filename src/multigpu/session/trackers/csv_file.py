"""``"csv"``: ``<run_dir>/metrics.csv`` in long form, one row per value: ``step,metric,value,time``.

``time`` is seconds since the log was opened, so metrics can come and go between steps. Each row is
flushed, so a crashed run keeps every line written so far. Hyperparameters go to
``<run_dir>/hparams.json``, updated under the kernel's lock on the folder (two writers at once each keep the
other's keys). A run resumed from a checkpoint at step S first drops the rows of steps
after S (a crash left them; the resumed run logs them again), so each step is in the file once; a row that a
killed process left without its newline is dropped when the file is opened again (the next would join it).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from multigpu.core.folder_turns import taking_turns
from multigpu.core.run_files import open_appending, remove_partials, write_replacing
from multigpu.errors import ConfigError
from multigpu.session.trackers.base import RunInfo, Tracker
from multigpu.session.trackers.own_files import check_own_file, read_json, refusal

CSV_NAME = "metrics.csv"
HPARAMS_NAME = "hparams.json"
_HEADER = ["step", "metric", "value", "time"]
_WHAT = "the metrics.csv the csv tracker writes"
_HPARAMS_WHAT = "the JSON object of hyperparameters this run's csv tracker writes"
_HOLD_S = 30.0  # seconds another writer of hparams.json may hold the run folder's lock (it holds it for milliseconds)


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
        if check_own_file(path, _WHAT) and path.stat().st_size:
            _check_header(path)
            if run.resumed_step is not None or _cut_short(path):
                _rewrite(path, run.resumed_step)
        try:
            fd = open_appending(path)  # never through a link, never blocking on a pipe put there since
        except OSError as error:
            raise refusal(path, _WHAT, f"not writable ({error})") from None
        file = os.fdopen(fd, "a", newline="", encoding="utf-8")
        if os.fstat(fd).st_size == 0:
            csv.writer(file).writerow(_HEADER)
        return cls(run.folder, file)

    def log(self, values: Mapping[str, float], step: int) -> None:
        now = round(time.monotonic() - self._began, 3)
        for name, value in values.items():
            self._csv.writerow([step, name, repr(value), now])
        self._file.flush()  # a crashed run keeps every line written so far

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        path = self.folder / HPARAMS_NAME
        with _folder_held(self.folder) as held:  # from the read to the rename: another writer's keys are never dropped
            if held:  # no writer is inside its turn: a partial here is a killed one's
                remove_partials(path)
            kept = _read_hparams(path) if check_own_file(path, _HPARAMS_WHAT) else {}
            write_replacing(path, json.dumps({**kept, **hparams}, indent=1, sort_keys=True) + "\n")  # whole or none

    def close(self, *, failed: bool = False) -> None:
        self._file.close()


def _folder_held(folder: Path) -> contextlib.AbstractContextManager[bool]:
    """Two writers of ``hparams.json`` (two processes logging into one folder, or threads) update it one after the
    other (:mod:`multigpu.core.folder_turns`).

    Raises:
        ConfigError: another writer held it for :data:`_HOLD_S` seconds (a stopped process), naming the folder.
    """

    def held_too_long(message: str) -> ConfigError:
        return ConfigError(
            f"{message} while this one logged its hyperparameters (a stopped run logging into the same folder?); "
            "give each run its own run_dir (Session(run_dir=...))"
        )

    return taking_turns(folder, hold_s=_HOLD_S, held_too_long=held_too_long)


def _cut_short(path: Path) -> bool:
    """Whether the file's last row was cut short by a process killed while writing it (the next would join it): it
    lacks its newline, or ends inside a quoted field (a metric's name may hold a newline; quotes come in pairs)."""
    quotes, last = 0, b""
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):  # a long run's file, a piece at a time
            quotes, last = quotes + chunk.count(b'"'), chunk[-1:]
    return last != b"\n" or quotes % 2 == 1


def _check_header(path: Path) -> None:
    """Refuse a CSV another program wrote (its rows are neither appended to nor rewritten): not this header."""
    ours = ",".join(_HEADER).encode()
    with path.open("rb") as file:
        line = file.readline(len(ours) + 2)
    if line.rstrip(b"\r\n") != ours and not (ours.startswith(line) and not line.endswith(b"\n")):  # a header cut short
        raise refusal(path, _WHAT, f"a CSV of another header ({line[:80]!r})")


def _rewrite(path: Path, step: int | None) -> None:
    """Rewrite ``path`` without the rows of steps after ``step`` (None: keep every step) and without a last row a
    kill cut short: a new file renamed over the old one."""
    cut = _cut_short(path)
    limit = csv.field_size_limit()  # a metric's name may be longer than csv's default (128 Ki characters)
    try:
        csv.field_size_limit(max(limit, path.stat().st_size))
        with path.open(newline="", encoding="utf-8") as file:
            rows = list(csv.reader(file))
    except (UnicodeDecodeError, csv.Error) as error:
        raise refusal(path, _WHAT, f"a file it cannot have written ({error})") from None
    finally:
        csv.field_size_limit(limit)
    if cut:
        rows = rows[:-1]
    kept = [row for row in rows[1:] if row and _kept(_step(row[0]), step)]
    if not cut and len(kept) == len(rows) - 1:
        return
    text = io.StringIO(newline="")
    csv.writer(text).writerows([_HEADER, *kept])
    write_replacing(path, text.getvalue())


def _kept(row_step: int | None, step: int | None) -> bool:
    return row_step is not None and (step is None or row_step <= step)


def _step(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() else None  # '²' is a digit to str.isdigit, not to int


def _read_hparams(path: Path) -> dict[str, Any]:
    """The hyperparameters logged so far in the regular file ``path``.

    Raises:
        ConfigError: the file is not a JSON object (not one this tracker wrote), naming it and the fix.
    """
    kept = read_json(path, _HPARAMS_WHAT)
    if not isinstance(kept, dict):
        raise refusal(path, _HPARAMS_WHAT, f"a JSON {type(kept).__name__}")
    return kept
