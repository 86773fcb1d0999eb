"""The experiment trackers' run identity, carried by every checkpoint: what makes a relaunch the same run.

A Session with trackers hands this module its :class:`IdentityKeeper` when it starts (and takes it back
when it closes); :class:`multigpu.Checkpointer` asks it for the identity at each ``save`` (stored in
``state.pt``'s ``extra`` under :data:`IDENTITY_KEY`) and gives the saved one back at ``resume``, so the
resumed Session continues the same MLflow run, W&B id, Aim hash, trackio run and run folder without a
line of the user's. It lives here, below both the Session and the checkpoints, so that neither imports
the other (as :mod:`multigpu.runtime.committed_steps` does for ``global_step``). Without a Session
nothing is saved, and a saved identity is left unused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from multigpu.errors import ConfigError

IDENTITY_KEY = "multigpu.trackers"  # the key of state.pt's extra that holds it


class IdentityKeeper(Protocol):
    """The Session's side: its trackers' identity, and where a resumed one goes."""

    def tracker_identity(self) -> dict[str, Any] | None:
        """What a checkpoint saved now stores (plain values), or None: no tracker run exists yet."""

    def check_tracker_identity(self, saved: Any, file: Path) -> None:
        """Raise a CheckpointError naming ``file`` when ``saved`` is not an identity this keeper wrote."""

    def continue_trackers(self, saved: Mapping[str, Any] | None, step: int) -> None:
        """Continue the runs ``saved`` names (None: the checkpoint holds none), the steps after ``step`` again."""


_keeper: IdentityKeeper | None = None


def keep_identity(keeper: IdentityKeeper) -> None:
    """The Session that starts: its trackers' identity goes with every checkpoint from now on."""
    global _keeper
    _keeper = keeper


def release_identity(keeper: IdentityKeeper) -> None:
    """The Session that closes: checkpoints no longer carry its identity (a later Session's stays)."""
    global _keeper
    if _keeper is keeper:
        _keeper = None


def with_identity(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``extra`` as a checkpoint stores it: with the running Session's tracker identity, when it has one.

    Raises:
        ConfigError: ``extra`` has :data:`IDENTITY_KEY` of its own.
    """
    if IDENTITY_KEY in extra:
        raise ConfigError(
            f"extra has the key {IDENTITY_KEY!r}, which the Checkpointer fills with the Session's tracker runs; "
            "rename your key"
        )
    identity = _keeper.tracker_identity() if _keeper is not None else None
    return dict(extra) if identity is None else {**extra, IDENTITY_KEY: identity}


def check_identity(extra: Mapping[str, Any], file: Path) -> None:
    """Before a resume changes anything: refuse a saved identity the running Session cannot continue."""
    if _keeper is not None and IDENTITY_KEY in extra:
        _keeper.check_tracker_identity(extra[IDENTITY_KEY], file)


def resume_identity(extra: Mapping[str, Any], step: int) -> dict[str, Any]:
    """After a resume: the running Session continues the saved runs; ``extra`` as the user saved it."""
    if _keeper is not None:
        _keeper.continue_trackers(extra.get(IDENTITY_KEY), step)
    return {key: value for key, value in extra.items() if key != IDENTITY_KEY}
