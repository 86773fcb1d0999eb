"""What ``session.log`` and ``session.log_hparams`` rest on: the numbers checked, then handed to every tracker.

Every rank may call :meth:`MetricsLog.log` (a training loop need not ask which rank it is); only
the main process writes, so a ddp run has one record, not one per process. Nothing is
communicated: reduce a metric first (``session.reduce(loss)``) to log the mean over processes.
Whatever mapping reaches ``log`` goes to every tracker (:mod:`multigpu.session.trackers`), with
the same step. Without a choice of trackers: ``<run_dir>/metrics.csv`` in long form
(``step,metric,value,time``) and, with TensorBoard installed, event files in the same folder.

The trackers open at the first ``log``, ``log_hparams`` or ``state``. :meth:`MetricsLog.state` is the
run's identity in each tracker (saved with a checkpoint); :meth:`MetricsLog.resume` takes it back
before they open, so a relaunched run continues the same tracker runs.

Example:
    >>> log = MetricsLog(tmp_path, enabled=True)  # doctest: +SKIP
    >>> log.log({"loss": 0.25}, step=1)           # doctest: +SKIP
"""

from __future__ import annotations

import numbers
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from multigpu.errors import ConfigError
from multigpu.session.trackers import TRACKERS, RunInfo, Tracker, default_trackers
from multigpu.session.trackers.csv_file import CSV_NAME

__all__ = ["CSV_NAME", "STATE_KEY", "MetricsLog"]

STATE_KEY = "multigpu.trackers"  # the key of Checkpointer.save(extra=...) that holds the trackers' identity


class MetricsLog:
    """Hands scalar metrics and hyperparameters to the run's trackers, on the main process only.

    Args:
        folder: the run folder (created when the trackers open).
        enabled: whether this process writes (True on the main process).
        trackers: tracker names (:data:`multigpu.session.trackers.TRACKERS`); None: CSV, and
            TensorBoard when installed.
        run_name: the run's name in the trackers; None: the folder's name.
        options: each tracker's keywords for its library, by tracker name.
    """

    def __init__(
        self,
        folder: Path,
        *,
        enabled: bool,
        trackers: Sequence[str] | None = None,
        run_name: str | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.folder = folder
        self.enabled = enabled
        self.names = tuple(trackers) if trackers is not None else default_trackers()
        self._run_name = run_name
        self._options = dict(options or {})
        self._run_id = uuid.uuid4().hex
        self._resumed: Mapping[str, Any] = {}
        self._resumed_step: int | None = None
        self._open: list[Tracker] | None = None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Write ``metrics`` (name -> number or one-element tensor) at ``step``. Every rank may call it.

        Raises:
            ConfigError: ``step`` is not a non-negative integer, a name is not a string, or a
                value is not one number (checked on every rank, so a bad call fails everywhere).
        """
        values = _scalars(metrics)
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step={step!r} must be an integer >= 0 (e.g. the optimizer step count)")
        if self.enabled:
            for tracker in self._trackers():
                tracker.log(values, int(step))

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (name -> str, int, float, bool or None) in every tracker.

        Raises:
            ConfigError: not a mapping, a name that is not a string, or a value of another type.
        """
        checked = _hparams(hparams)
        if self.enabled:
            for tracker in self._trackers():
                tracker.log_hparams(checked)

    def state(self) -> dict[str, Any]:
        """``{STATE_KEY: ...}``: the run's id, folder, name and each tracker's identity, for ``Checkpointer.save(extra=)``.

        The main process opens the trackers if they are not yet open; the others return an empty
        identity (only the main process's extra is written).
        """
        if not self.enabled:
            return {STATE_KEY: {}}
        trackers = self._trackers()
        return {
            STATE_KEY: {
                "run_id": self._run_id,
                "run_dir": str(self.folder.resolve()),  # a relaunch may start elsewhere
                "run_name": self.run_name,
                "trackers": {tracker.name: tracker.state() for tracker in trackers},
            }
        }

    def resume(self, extra: Mapping[str, Any], step: int, *, keep_folder: bool) -> None:
        """Continue the tracker runs that ``extra`` (a checkpoint's, with :meth:`state` in it) names.

        Args:
            extra: ``Resumed.extra`` of the checkpoint.
            step: the checkpoint's step: the trackers treat later steps as logged again.
            keep_folder: keep this log's folder (the user chose it); else take the saved one.

        Raises:
            ConfigError: the trackers are already open (resume before the first log), or ``extra``
                holds no tracker identity (the checkpoint was saved without it).
        """
        if self._open is not None:
            raise ConfigError(
                "session.resume_trackers(resumed) came after the trackers opened (at the first log, log_hparams "
                "or tracker_state); call it right after Checkpointer.resume, before logging"
            )
        saved = extra.get(STATE_KEY) if isinstance(extra, Mapping) else None
        if not isinstance(saved, Mapping):
            raise ConfigError(
                f"the checkpoint's extra holds no {STATE_KEY!r}: save it with "
                "Checkpointer.save(..., extra=session.tracker_state()) to continue the same tracker runs"
            )
        self._resumed_step = int(step)
        if not saved:  # written by a process that did not log (no main process's identity)
            return
        run_id, run_name, run_dir, trackers = (saved.get(k) for k in ("run_id", "run_name", "run_dir", "trackers"))
        if not all(isinstance(v, str) for v in (run_id, run_name, run_dir)) or not isinstance(trackers, Mapping):
            raise ConfigError(
                f"the checkpoint's {STATE_KEY!r} is not what session.tracker_state() writes (run_id, run_name, "
                f"run_dir, trackers): {saved!r}; resume from a checkpoint saved with extra=session.tracker_state()"
            )
        self._run_id = str(run_id)
        self._run_name = self._run_name or str(run_name)
        if not keep_folder:
            self.folder = Path(str(run_dir))
        self._resumed = trackers

    @property
    def run_name(self) -> str:
        return self._run_name or self.folder.name

    def close(self, *, failed: bool = False) -> None:
        """End every tracker's part of the run, as failed when the loop raised (safe to call twice)."""
        trackers, self._open = self._open or [], None
        errors = []
        for tracker in trackers:  # every tracker closes, even after another failed to
            try:
                tracker.close(failed=failed)
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]

    def _trackers(self) -> list[Tracker]:
        if self._open is None:
            self._open = []
            for name in self.names:
                resumed = self._resumed.get(name)
                run = RunInfo(
                    folder=self.folder,
                    name=self.run_name,
                    run_id=self._run_id,
                    options=self._options.get(name, {}),
                    resumed=resumed,
                    resumed_step=self._resumed_step,
                )
                self._open.append(TRACKERS[name].open(run))
        return self._open


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


def _hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(hparams, Mapping):
        raise ConfigError(
            f"session.log_hparams takes a mapping of name -> value, got {type(hparams).__name__}; e.g. {{'lr': 0.1}}"
        )
    checked: dict[str, Any] = {}
    for name, value in hparams.items():
        if not isinstance(name, str):
            raise ConfigError(f"hyperparameter name {name!r} must be a string, e.g. 'lr'")
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
        elif not isinstance(value, (str, bool)) and value is not None:
            raise ConfigError(
                f"hyperparameter {name!r} is a {type(value).__name__}; log a str, int, float, bool or None "
                f"(flatten nested settings, e.g. {{'{name}.size': ...}})"
            )
        checked[name] = value
    return checked
