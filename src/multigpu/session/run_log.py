"""What a Session logs: :class:`RunLog`, a base class of :class:`~multigpu.session.Session`.

``session.log`` hands a mapping of scalars to every tracker of ``Session(trackers=...)``
(:mod:`multigpu.session.metrics`, :mod:`multigpu.session.trackers`), with the step's throughput figures
added (:mod:`multigpu.session.throughput`). A :class:`multigpu.Checkpointer` saves the trackers' run
identity with every checkpoint and its ``resume`` continues the same runs, through the methods of the
``IdentityKeeper`` below (:mod:`multigpu.runtime.run_identity`). Only the main process writes; nothing
here communicates.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multigpu.runtime import world
from multigpu.session.metrics import MetricsLog

if TYPE_CHECKING:
    from multigpu.session.config import SessionConfig
    from multigpu.session.throughput import Throughput
    from multigpu.strategies import Precision, Strategy


class RunLog:
    """The Session's logging methods; the Session provides ``config``, ``_started``, ``_throughput``, ``_metrics``."""

    if TYPE_CHECKING:  # the Session's
        config: SessionConfig
        _throughput: Throughput
        _metrics: MetricsLog | None

        def _started(self) -> tuple[Strategy, Precision]: ...

    @property
    def run_dir(self) -> Path:
        """The folder :meth:`log` writes into: ``SessionConfig.run_dir``, else ``runs/<run token>`` under
        ``multigpu launch`` (``MULTIGPU_RUN_ID``), else ``runs/<start time>-<strategy>``."""
        return self._metrics_log().folder

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Hand scalar ``metrics`` at ``step`` to every tracker (by default ``run_dir/metrics.csv`` and TensorBoard).

        Only the main process writes, so every rank may call it without duplicates; nothing is
        communicated (log ``session.reduce(loss)`` for the mean over processes). Whatever mapping
        reaches it goes to every tracker of ``Session(trackers=...)``. See
        :mod:`multigpu.session.metrics` and :mod:`multigpu.session.trackers`. When optimizer steps ran
        since the last call, their figures are added (a metric of yours of the same name wins):
        ``step_time_s``, ``samples_per_s``, ``tokens_per_s`` (with ``tokens_per_sample``), ``mfu``, and
        with several processes ``slowest_rank`` and ``slowest_rank_ratio`` (:mod:`multigpu.session.throughput`).

        Example:
            >>> session.log({"loss": session.reduce(loss), "lr": 0.1}, step)  # doctest: +SKIP
        """
        figures = self._throughput.figures(self._started()[0], self.config.precision)
        if figures and isinstance(metrics, Mapping):  # the caller's own metric of the same name wins
            metrics = {**metrics, **{name: v for name, v in figures.items() if name not in metrics}}
        self._metrics_log().log(metrics, step)

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters (name -> str, int, float, bool or None) in every tracker.

        Main process only writes; every rank may call it. Call it before the first :meth:`log`
        (trackio attaches them to the first logged values).

        Example:
            >>> session.log_hparams({"lr": 0.1, "batch_size": 64, "strategy": session.strategy_name})  # doctest: +SKIP
        """
        self._metrics_log().log_hparams(hparams)

    @functools.cached_property
    def _tracker_runs(self) -> TrackerRuns:
        """What the running Session lends the checkpoints (:func:`multigpu.runtime.run_identity.keep_identity`)."""
        return TrackerRuns(self)

    def _metrics_log(self) -> MetricsLog:
        if self._metrics is None:
            strategy, _ = self._started()
            token = world.run_token()  # multigpu launch's: the same in a restarted process, so the same folder
            default = token if token is not None else f"{time.strftime('%Y%m%d-%H%M%S')}-{strategy.name}"
            folder = self.config.run_dir or Path("runs") / default
            self._metrics = MetricsLog(
                Path(folder),
                enabled=strategy.is_main_process,
                trackers=self.config.trackers,
                run_name=self.config.run_name,
                options=self.config.tracker_options,
                token=token,
            )
        return self._metrics


class TrackerRuns:
    """A Session's :class:`~multigpu.runtime.run_identity.IdentityKeeper`: its trackers' runs, as checkpoints see them."""

    def __init__(self, log: RunLog) -> None:
        self._log = log

    def tracker_identity(self) -> dict[str, Any] | None:
        """What ``Checkpointer.save`` stores (None: no tracker run yet, or not the main process)."""
        metrics = self._log._metrics
        return metrics.identity() if metrics is not None else None

    def check_tracker_identity(self, saved: Any, file: Path) -> None:
        """Before ``Checkpointer.resume`` changes anything: refuse an identity the trackers cannot continue."""
        MetricsLog.check_identity(saved, file)

    def continue_trackers(self, saved: Mapping[str, Any] | None, step: int) -> None:
        """After ``Checkpointer.resume``: the next log continues the saved runs, in the first run folder unless
        ``SessionConfig.run_dir`` names one, and the steps after ``step`` are logged again (docs/measuring.md)."""
        self._log._metrics_log().resume(saved, step, keep_folder=self._log.config.run_dir is not None)
