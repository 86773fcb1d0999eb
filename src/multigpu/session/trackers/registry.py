"""The trackers ``Session(trackers=...)`` knows, by name; add one by listing its class here."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence

from multigpu.core.lookup import lookup
from multigpu.errors import ConfigError
from multigpu.session.trackers.aim_run import AimTracker
from multigpu.session.trackers.base import Tracker
from multigpu.session.trackers.csv_file import CsvTracker
from multigpu.session.trackers.mlflow_run import MlflowTracker
from multigpu.session.trackers.tensorboard_events import TensorBoardTracker
from multigpu.session.trackers.trackio_run import TrackioTracker
from multigpu.session.trackers.wandb_run import WandbTracker

TRACKERS: dict[str, type[Tracker]] = {
    cls.name: cls for cls in (CsvTracker, TensorBoardTracker, MlflowTracker, WandbTracker, AimTracker, TrackioTracker)
}


def default_trackers() -> tuple[str, ...]:
    """Without ``trackers=``: the CSV, and TensorBoard when it is installed."""
    return ("csv", "tensorboard") if importlib.util.find_spec("tensorboard") is not None else ("csv",)


def check_trackers(names: object, options: object) -> tuple[str, ...]:
    """``names`` as a tuple of known tracker names, each once, with ``options`` only for those.

    Raises:
        ConfigError: an unknown or repeated name, options for a tracker not chosen, or options that
            set what multigpu keeps (the run's id).
    """
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ConfigError(f"trackers={names!r} must be a tuple of tracker names, e.g. trackers=('csv', 'mlflow')")
    for name in names:
        lookup(TRACKERS, name, f"trackers={names!r}: {{value!r}} is not one of {{choices}}", choices=sorted(TRACKERS))
    if len(set(names)) != len(names):
        raise ConfigError(f"trackers={names!r} names a tracker twice; list each once")
    if not isinstance(options, Mapping) or not all(isinstance(v, Mapping) for v in options.values()):
        raise ConfigError(
            f"tracker_options={options!r} must map a tracker's name to its keywords, "
            "e.g. tracker_options={'wandb': {'project': 'digits'}}"
        )
    for name, keywords in options.items():
        if name not in names:
            raise ConfigError(f"tracker_options has {name!r}, which is not in trackers={tuple(names)!r}; add it there")
        TRACKERS[name].check_options(keywords)
    return tuple(names)


def check_installed(names: Sequence[str]) -> None:
    """Raise a :class:`ConfigError` naming the extra of the first tracker whose library is missing."""
    for name in names:
        TRACKERS[name].check_installed()
