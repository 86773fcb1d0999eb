"""Experiment trackers behind ``session.log``: one small module per library, chosen by name.

``Session(trackers=("csv", "tensorboard", "mlflow", "wandb", "aim", "trackio"), run_name="lr-0.1")``:
every ``session.log(dict, step)`` reaches each of them, from the main process only. Each module says
where its tracker writes, how to view it, and what a crash-resume does to steps logged after the
checkpoint (docs/measuring.md has the table).

- :mod:`~multigpu.session.trackers.base`: what a tracker is (:class:`Tracker`, :class:`RunInfo`);
- :mod:`~multigpu.session.trackers.registry`: the names (``TRACKERS``); add a tracker there.
"""

from multigpu.session.trackers.base import RunInfo, Tracker
from multigpu.session.trackers.registry import TRACKERS, check_installed, check_trackers, default_trackers

__all__ = ["TRACKERS", "RunInfo", "Tracker", "check_installed", "check_trackers", "default_trackers"]
