"""Metrics of a run written once, by the main process: a CSV in the run folder, and TensorBoard when installed.

Every rank may call :meth:`MetricsLog.log` (a training loop need not ask which rank it is); only
the main process writes, so a ddp run has one file, not one line per process. Nothing is
communicated: reduce a metric first (``session.reduce(loss)``) to log the mean over processes.

The CSV is ``<run_dir>/metrics.csv`` in long form, one row per value: ``step,metric,value,time``
(``time``: seconds since the log was created), so metrics can come and go between steps. With
TensorBoard installed (``pip install tensorboard``), the same scalars go to event files in the
same folder.

Example:
    >>> log = MetricsLog(tmp_path, enabled=True)  # doctest: +SKIP
    >>> log.log({"loss": 0.25}, step=1)           # doctest: +SKIP
"""

from __future__ import annotations

import csv
import numbers
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

from multigpu.errors import ConfigError

CSV_NAME = "metrics.csv"


class MetricsLog:
    """Appends scalar metrics to ``folder/metrics.csv`` (and TensorBoard), on the main process only.

    Args:
        folder: the run folder (created on the first :meth:`log`).
        enabled: whether this process writes (True on the main process).
    """

    def __init__(self, folder: Path, *, enabled: bool) -> None:
        self.folder = folder
        self.enabled = enabled
        self._file: IO[str] | None = None
        self._csv: Any = None
        self._board: Any = None
        self._began = time.monotonic()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Write ``metrics`` (name -> number or one-element tensor) at ``step``. Every rank may call it.

        Raises:
            ConfigError: ``step`` is not a non-negative integer, a name is not a string, or a
                value is not one number (checked on every rank, so a bad call fails everywhere).
        """
        values = _scalars(metrics)
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step={step!r} must be an integer >= 0 (e.g. the optimizer step count)")
        if not self.enabled:
            return
        file = self._file or self._open()
        now = round(time.monotonic() - self._began, 3)
        for name, value in values.items():
            self._csv.writerow([int(step), name, repr(value), now])
            if self._board is not None:
                self._board.add_scalar(name, value, int(step))
        file.flush()  # a crashed run keeps every line written so far

    def close(self) -> None:
        """Flush and close the files (safe to call twice)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            self._board.close()
            self._board = None

    def _open(self) -> IO[str]:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / CSV_NAME
        fresh = not path.exists() or path.stat().st_size == 0
        self._file = file = path.open("a", newline="", encoding="utf-8")
        self._csv = csv.writer(file)
        if fresh:
            self._csv.writerow(["step", "metric", "value", "time"])
        self._board = _tensorboard(self.folder)
        return file


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            f"session.log takes a mapping of name -> value, got {type(metrics).__name__}; e.g. {{'loss': loss}}"
        )
    values = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise ConfigError(f"metric name {name!r} must be a string, e.g. 'loss'")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ConfigError(
                f"metric {name!r} is a {type(value).__name__}, not one number; log a float or a one-element tensor "
                "(e.g. loss.detach(), or session.reduce(loss) for the mean over processes)"
            )
        values[name] = float(value)
    return values


def _tensorboard(folder: Path) -> Any:
    """A TensorBoard writer into ``folder`` when tensorboard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(log_dir=str(folder))
