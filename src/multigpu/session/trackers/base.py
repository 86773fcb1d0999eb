"""What every experiment tracker is to the Session: a run it opens, numbers it logs, an identity it keeps.

A tracker is one small class per library (:mod:`~multigpu.session.trackers.registry` lists them). The
Session opens it on the main process only, at the first ``log``, with a :class:`RunInfo`; every
``session.log`` reaches every tracker with the same numbers and step. Its :meth:`Tracker.state` is what it
needs to find the same run again (a run id, the store it lives in): saved with every checkpoint
(:mod:`multigpu.runtime.run_identity`), it comes back in :attr:`RunInfo.resumed` after a relaunch, with
the checkpoint's step in :attr:`RunInfo.resumed_step`.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from multigpu.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """Where and as what a tracker records this run.

    Attributes:
        folder: the run folder (``SessionConfig.run_dir``): the CSV and TensorBoard write here.
        name: the run's name in every tracker (``SessionConfig.run_name``, else the folder's name).
        run_id: multigpu's id of the run (32 hex digits), the same in every tracker that takes one; made from
            the launch's run token (``MULTIGPU_RUN_ID``) when there is one. Without :attr:`resumed`, a tracker
            continues the run of this id when its store has one (a restarted main process), else creates it.
        options: this tracker's keywords from ``SessionConfig.tracker_options`` (passed to its library).
        resumed: what :meth:`Tracker.state` returned when the resumed checkpoint was saved; None: a new run.
        resumed_step: the resumed checkpoint's step, or for a restart without a checkpoint the step before the
            first one this process logs; steps after it are logged again by this process.
    """

    folder: Path
    name: str
    run_id: str
    options: Mapping[str, Any] = field(default_factory=dict)
    resumed: Mapping[str, Any] | None = None
    resumed_step: int | None = None


class Tracker(ABC):
    """One experiment tracker's glue: open a run (or find it again), log scalars, log hyperparameters, close.

    Subclasses set ``name`` (what ``Session(trackers=...)`` spells), ``modules`` (what must be
    importable) and ``extra`` (the pip extra that installs them), and build themselves in :meth:`open`.
    """

    name: ClassVar[str]
    modules: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str | None] = None
    refused_options: ClassVar[tuple[str, ...]] = ()  # keywords multigpu sets itself (the run's identity)
    allowed_options: ClassVar[tuple[str, ...] | None] = None  # None: any keyword of the library's own call

    @classmethod
    def check_installed(cls) -> None:
        """Raise a :class:`ConfigError` naming the extra when the tracker's library is not installed."""
        missing = [m for m in cls.modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"tracker {cls.name!r} needs {', '.join(missing)}, which is not installed: "
                f"pip install 'multigpu[{cls.extra}]' (or drop {cls.name!r} from Session(trackers=...))"
            )

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Refuse the keywords that would change the run's identity behind multigpu's back."""
        if cls.allowed_options is not None and set(options) - set(cls.allowed_options):
            unknown = sorted(set(options) - set(cls.allowed_options))
            raise ConfigError(
                f"tracker_options[{cls.name!r}] has {unknown}; the {cls.name!r} tracker takes "
                f"{list(cls.allowed_options) or 'no options'}"
            )
        taken = sorted(set(options) & set(cls.refused_options))
        if taken:
            raise ConfigError(
                f"tracker_options[{cls.name!r}] sets {taken}, which multigpu chooses to keep one run across "
                "relaunches (the run's name is Session(run_name=...)); remove them"
            )

    @classmethod
    @abstractmethod
    def open(cls, run: RunInfo) -> Tracker:
        """The run ``run.resumed`` identifies, else the run of ``run.run_id`` in the store, else a new one, ready to log."""

    @abstractmethod
    def log(self, values: Mapping[str, float], step: int) -> None:
        """Record ``values`` (name -> float) at ``step``."""

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:  # noqa: B027 (a tracker may keep none)
        """Record the run's hyperparameters (name -> str, int, float, bool or None)."""

    def state(self) -> dict[str, Any]:
        """What finds this run again after a relaunch (plain values: it is saved in a checkpoint)."""
        return {}

    @abstractmethod
    def close(self, *, failed: bool = False) -> None:
        """Flush and end this process's part of the run (``failed``: the loop raised, where the tracker has a status)."""
