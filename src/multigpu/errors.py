"""Typed errors for user input. Every message names the value and says how to fix it."""

from __future__ import annotations


class MultigpuError(Exception):
    """Base class of every error multigpu raises on purpose."""


class DeviceError(MultigpuError, ValueError):
    """A device specification that does not parse or names hardware that is not there."""


class PlacementError(MultigpuError, ValueError, RuntimeError):
    """A module or tensor that is not where the engine needs it (a RuntimeError too, as torch's DataParallel raises)."""


class ScatterError(MultigpuError, ValueError):
    """Inputs that cannot be split into chunks (empty batch, batch sizes that disagree)."""


class GatherError(MultigpuError, ValueError):
    """Replica outputs that cannot be put back together."""


class ConfigError(MultigpuError, ValueError):
    """An option with a value outside what it accepts."""


class CheckpointError(MultigpuError, RuntimeError):
    """A checkpoint that cannot be written or does not match the model."""


class CollectiveTimeoutError(MultigpuError, RuntimeError):
    """A collective did not complete within the process group's timeout (a rank stopped calling it)."""


class CollectiveMismatchError(MultigpuError, RuntimeError):
    """The ranks issued different collectives (operation, shape or dtype), found by the ``--debug`` check."""


class PeerExitedError(MultigpuError, RuntimeError):
    """Another rank went away while this one waited in a collective."""


class LaunchError(MultigpuError, RuntimeError):
    """A multi-process run that cannot start: not launched, port in use, process group missing."""


class LaunchTimeoutError(LaunchError):
    """Ranks of :func:`~multigpu.launcher.function.launch_function` still running when its ``timeout`` passed."""


class ResultError(LaunchError):
    """A rank's return value that cannot travel to the caller (it does not pickle there, or here)."""
