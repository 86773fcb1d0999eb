"""The optimizer steps this process's training has committed: ``session.global_step``, kept in one place.

The Session counts a step when ``session.step`` applies it; a :class:`multigpu.Checkpointer` saves the
count with every checkpoint and ``resume`` puts it back; under ``--fault-tolerant`` a restarted replica
group receives it live (:mod:`multigpu.session.fault_tolerance`). It lives here, below both the Session
and the checkpoints, so that neither imports the other. One process trains one run at a time: a
Session's start sets it to 0, so resume after starting the Session (as the model it loads needs anyway).
"""

from __future__ import annotations

from multigpu.errors import ConfigError

_committed = 0


def committed_steps() -> int:
    """The optimizer steps committed in this run (``session.global_step``)."""
    return _committed


def set_committed_steps(value: int) -> None:
    """Set the count (a Session's start, a resumed checkpoint, a live recovery).

    Raises:
        ConfigError: ``value`` is not an int >= 0.
    """
    global _committed
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"global_step={value!r} must be an int >= 0 (e.g. the step a checkpoint resumed)")
    _committed = value
