"""What ``session.log`` and ``session.log_hparams`` rest on: the numbers checked, then handed to every tracker.

Every rank may call :meth:`MetricsLog.log` (a training loop need not ask which rank it is); only
the main process writes, so a ddp run has one record, not one per process. Nothing is
communicated: reduce a metric first (``session.reduce(loss)``) to log the mean over processes.
Whatever mapping reaches ``log`` goes to every tracker (:mod:`multigpu.session.trackers`), with
the same step. Without a choice of trackers: ``<run_dir>/metrics.csv`` in long form
(``step,metric,value,time``) and, with TensorBoard installed, event files in the same folder.

The trackers open at the first ``log`` (hyperparameters logged before wait for it, so that a resume
after ``log_hparams`` still continues the saved runs). :meth:`MetricsLog.identity` is the run's identity
in each tracker, which every checkpoint saves (:mod:`multigpu.runtime.run_identity`);
:meth:`MetricsLog.resume` takes it back before they open, so a relaunched run continues the same runs.
Without a checkpoint's identity, a launch's run token (``MULTIGPU_RUN_ID``, the same in every replica group
and every restart of one ``multigpu launch``) gives the run's id: each tracker finds the run of that id in
its store or creates it, so a restarted main process continues the same runs. The run folder keeps the
run's identity and the token (:data:`RUN_RECORD`, written when the trackers open); a process that finds its
own token there is a restart of the run: it continues those runs as a checkpoint's resume would, and logs
again the steps from its first ``log`` on (the trackers treat it as a resume from the step before).

Example:
    >>> log = MetricsLog(tmp_path, enabled=True)  # doctest: +SKIP
    >>> log.log({"loss": 0.25}, step=1)           # doctest: +SKIP
"""

from __future__ import annotations

import json
import numbers
import re
import reprlib
import sys
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from multigpu.core.limits import to_float
from multigpu.core.run_files import write_replacing
from multigpu.errors import CheckpointError, ConfigError
from multigpu.runtime.run_identity import IDENTITY_KEY
from multigpu.session.trackers import TRACKERS, RunInfo, Tracker, default_trackers
from multigpu.session.trackers.csv_file import CSV_NAME
from multigpu.session.trackers.own_files import NotOwnFile, check_own_file, read_json

__all__ = ["CSV_NAME", "RUN_RECORD", "MetricsLog", "run_id_of"]

RUN_RECORD = "multigpu-run.json"  # in the run folder of a launch: the run's identity, which a restart continues
_RECORD_WHAT = "the run record multigpu writes"
_RUN_ID = re.compile(r"[0-9a-f]{32}")  # what run_id_of and uuid4().hex make
_TOKEN_IDS = uuid.UUID("5f0c7d1e-3b59-4e43-9a57-3c2b8f9e6a10")  # the namespace of ids made from run tokens


def run_id_of(token: str) -> str:
    """The run's id (32 hex digits) a launch's run token names: the same token, the same id, in every process.

    Example:
        >>> run_id_of("digits-lr0.1") == run_id_of("digits-lr0.1") != run_id_of("digits-lr0.2")
        True
    """
    return uuid.uuid5(_TOKEN_IDS, token).hex


class MetricsLog:
    """Hands scalar metrics and hyperparameters to the run's trackers, on the main process only.

    Args:
        folder: the run folder (created when the trackers open).
        enabled: whether this process writes (True on the main process).
        trackers: tracker names (:data:`multigpu.session.trackers.TRACKERS`); None: CSV, and
            TensorBoard when installed.
        run_name: the run's name in the trackers; None: the folder's name.
        options: each tracker's keywords for its library, by tracker name.
        token: the launch's run token (``MULTIGPU_RUN_ID``): the run's id is made from it, and each tracker
            continues the run of that id when its store has one; None: a new id, a new run.
    """

    def __init__(
        self,
        folder: Path,
        *,
        enabled: bool,
        trackers: Sequence[str] | None = None,
        run_name: str | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        token: str | None = None,
    ) -> None:
        self.folder = folder
        self.enabled = enabled
        self.names = tuple(trackers) if trackers is not None else default_trackers()
        self._run_name = self._chosen_name = run_name
        self._options = dict(options or {})
        self._token = token
        self._run_id = run_id_of(token) if token is not None else uuid.uuid4().hex
        self._resumed: Mapping[str, Any] = {}  # each tracker's saved identity, by name
        self._saved: Mapping[str, Any] | None = None  # the resumed checkpoint's identity, whole
        self._hparams: dict[str, Any] = {}  # what log_hparams recorded before the trackers opened
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
            for tracker in self._trackers(first_step=int(step)):
                tracker.log(values, int(step))

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (name -> str, int, float, bool or None) in every tracker.

        Raises:
            ConfigError: not a mapping, a name that is not a string, or a value of another type.
        """
        checked = _hparams(hparams)
        self._hparams.update(checked)  # written when the trackers open, if they are not open yet
        if self.enabled and self._open is not None:
            for tracker in self._open:
                tracker.log_hparams(checked)

    def identity(self) -> dict[str, Any] | None:
        """The run's id, folder, name and each tracker's identity, which a checkpoint saves; None: no run yet.

        None on the other processes (only the main process's is written), and before the trackers open
        unless a resumed identity waits for them (a run resumed and saved again before its first log).
        """
        if not self.enabled or not self.names:
            return None
        if self._open is None:
            return dict(self._saved) if self._saved is not None else None
        return {
            "run_id": self._run_id,
            "run_dir": str(self.folder.resolve()),  # a relaunch may start elsewhere
            "run_name": self.run_name,
            "trackers": {tracker.name: tracker.state() for tracker in self._open},
        }

    @staticmethod
    def check_identity(saved: Any, file: Path) -> None:
        """Refuse (a :class:`CheckpointError` naming ``file``) what :meth:`identity` cannot have written."""
        fields = ("run_id", "run_name", "run_dir")
        if (
            not isinstance(saved, Mapping)
            or not all(isinstance(saved.get(k), str) for k in fields)
            or not _RUN_ID.fullmatch(saved["run_id"])  # it reaches MLflow's search filter, W&B's and trackio's names
            or not isinstance(saved.get("trackers"), Mapping)
            or not all(_tracker_state(k, v) for k, v in saved["trackers"].items())
        ):
            raise CheckpointError(
                f"{str(file)!r}: entry 'extra'[{IDENTITY_KEY!r}] is {reprlib.repr(saved)}; expected the run_id, "
                "run_name, run_dir and trackers a Checkpointer saves for a Session's trackers. Nothing was loaded: "
                "resume from another step (Checkpointer.resume(path=...))"
            )

    def resume(self, saved: Mapping[str, Any] | None, step: int, *, keep_folder: bool) -> None:
        """Continue the tracker runs ``saved`` (what :meth:`identity` returned at the save) names.

        Args:
            saved: the checkpoint's identity (checked by :meth:`check_identity`); None: it holds none,
                and the next runs are new ones.
            step: the checkpoint's step: the trackers treat later steps as logged again.
            keep_folder: keep this log's folder (the user chose it); else take the saved one.

        Trackers already open (a ``log`` came before the resume) are closed first, with a warning:
        what they logged stays in new runs of their own, and the saved runs continue.
        """
        if self._open is not None:
            if self.enabled:
                warnings.warn(
                    "session.log came before Checkpointer.resume, so the trackers opened new runs; those are "
                    "closed and the checkpoint's runs continue (resume before the first session.log)",
                    RuntimeWarning,
                    stacklevel=5,  # the caller of Checkpointer.resume
                )
            self.close()
        self._resumed_step = int(step)
        self._saved = saved
        if saved is None:
            self._resumed = {}
            return
        self._run_id = str(saved["run_id"])
        self._run_name = self._chosen_name or str(saved["run_name"])
        if not keep_folder:
            self.folder = Path(str(saved["run_dir"]))
        self._resumed = saved["trackers"]

    @property
    def run_name(self) -> str:
        return self._run_name or self.folder.name

    def close(self, *, failed: bool = False) -> None:
        """End every tracker's part of the run, as failed when the loop raised (safe to call twice)."""
        if self.enabled and self._open is None and self._hparams:  # hyperparameters alone still make a run
            self._trackers()
        trackers, self._open = self._open or [], None
        errors = []
        for tracker in trackers:  # every tracker closes, even after another failed to
            try:
                tracker.close(failed=failed)
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]

    def _trackers(self, first_step: int | None = None) -> list[Tracker]:
        if self._open is None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as error:  # a file there, or above it
                raise ConfigError(
                    f"the run folder {str(self.folder)!r} cannot be made ({error.strerror or error}); pass "
                    "Session(run_dir=...) a folder, or a path where one can be made"
                ) from None
            if self._resumed_step is None and self._token is not None:  # no checkpoint resumed: a restart?
                self._continue_recorded(first_step)
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
            if self._token is not None and self.names:
                self._write_record()
            if self._hparams:
                for tracker in self._open:
                    tracker.log_hparams(self._hparams)
        return self._open

    def _continue_recorded(self, first_step: int | None) -> None:
        """Continue the runs the run folder's record names when it is this run's (a restarted main process).

        A process restarted without a checkpoint (a replica group healed live, a torchrun restart before the
        first save) logs from ``first_step`` on: what an earlier process of the run logged there is replaced.

        Raises:
            ConfigError: the record is not one :meth:`_write_record` wrote (named, with the fix).
        """
        path = self.folder / RUN_RECORD
        try:
            if not check_own_file(path, _RECORD_WHAT):
                return
            record = read_json(path, _RECORD_WHAT)
            MetricsLog.check_identity(record, path)
        except (NotOwnFile, CheckpointError) as error:
            found = error.why if isinstance(error, NotOwnFile) else reprlib.repr(record)
            raise ConfigError(
                f"{str(path)!r} is not the run record multigpu writes ({found}); "
                "delete it: the trackers then find the run by its id where they can, else start new runs"
            ) from None
        if record.get("token") == self._token:  # its runs: the token's, or those a checkpoint of it resumed
            self._run_id = str(record["run_id"])
            self._resumed = record["trackers"]
            self._resumed_step = None if first_step is None else first_step - 1

    def _write_record(self) -> None:
        """The run's identity in its folder, whole or not at all (a new file renamed over the old one)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        check_own_file(self.folder / RUN_RECORD, _RECORD_WHAT)  # a folder there would fail the rename untyped
        record = {**(self.identity() or {}), "token": self._token}
        write_replacing(self.folder / RUN_RECORD, json.dumps(record, indent=1, sort_keys=True) + "\n")


def _tracker_state(name: Any, state: Any) -> bool:
    """Whether ``state`` is one a tracker's :meth:`~multigpu.session.trackers.Tracker.state` returns: names -> text
    (or None, where a library leaves a field unset)."""
    return (
        isinstance(name, str)
        and isinstance(state, Mapping)
        and all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in state.items())
    )


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
        values[name] = to_float(value)  # an int past the largest float: its infinity
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
            try:
                str(value)  # what a tracker's JSON or text writes: refused past sys.get_int_max_str_digits()
            except ValueError:
                raise ConfigError(
                    f"hyperparameter {name!r} is an int of more than {sys.get_int_max_str_digits()} digits; "
                    "log it as a str (no tracker can write it as a number)"
                ) from None
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
        elif not isinstance(value, (str, bool)) and value is not None:
            raise ConfigError(
                f"hyperparameter {name!r} is a {type(value).__name__}; log a str, int, float, bool or None "
                f"(flatten nested settings, e.g. {{'{name}.size': ...}})"
            )
        checked[name] = value
    return checked
