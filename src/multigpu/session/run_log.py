"""What a Session logs: :class:`RunLog`, a base class of :class:`~multigpu.session.Session`.

``session.log`` hands a mapping of scalars to every tracker of ``Session(trackers=...)``
(:mod:`multigpu.session.metrics`, :mod:`multigpu.session.trackers`), with the step's throughput figures
added (:mod:`multigpu.session.throughput`); the trackers' run identity is saved with a checkpoint
(:meth:`RunLog.tracker_state`) and continued after a resume (:meth:`RunLog.resume_trackers`). Only the
main process writes; nothing here communicates.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multigpu.errors import ConfigError
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
        """The folder :meth:`log` writes into: ``SessionConfig.run_dir``, else ``runs/<start time>-<strategy>``."""
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

    def tracker_state(self) -> dict[str, Any]:
        """The run's identity in every tracker, to save with a checkpoint: ``ckpt.save(..., extra=session.tracker_state())``.

        One entry (``"multigpu.trackers"``): merge it with your own ``extra`` keys. Every rank may
        call it (only the main process's is written).
        """
        return self._metrics_log().state()

    def resume_trackers(self, resumed: Any) -> None:
        """Continue the tracker runs a checkpoint saved with :meth:`tracker_state`; call before the first log.

        ``resumed`` is what ``Checkpointer.resume`` returned: its ``extra`` names the runs, its
        ``step`` says which steps come again. Without ``SessionConfig.run_dir`` the saved run folder
        is kept. What a tracker does with steps logged after the checkpoint (a crash-resume):
        docs/measuring.md. Every rank may call it.

        Example:
            >>> resumed = ckpt.resume(model=model, optimizer=optimizer)  # doctest: +SKIP
            >>> if resumed:                                              # doctest: +SKIP
            ...     session.resume_trackers(resumed)

        Raises:
            ConfigError: the trackers already opened, or the checkpoint holds no tracker identity.
        """
        extra, step = getattr(resumed, "extra", None), getattr(resumed, "step", None)
        if not isinstance(extra, Mapping) or not isinstance(step, int):
            raise ConfigError(
                f"session.resume_trackers takes what Checkpointer.resume returned, got {type(resumed).__name__}"
            )
        self._metrics_log().resume(extra, step, keep_folder=self.config.run_dir is not None)

    def _metrics_log(self) -> MetricsLog:
        if self._metrics is None:
            strategy, _ = self._started()
            folder = self.config.run_dir or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{strategy.name}"
            self._metrics = MetricsLog(
                Path(folder),
                enabled=strategy.is_main_process,
                trackers=self.config.trackers,
                run_name=self.config.run_name,
                options=self.config.tracker_options,
            )
        return self._metrics
