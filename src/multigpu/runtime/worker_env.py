"""What a launcher tells each worker it starts, as environment variables: one codec for both ends.

Every launch path (``multigpu launch``, :func:`~multigpu.launcher.function.launch_function`,
``multigpu advise --measure``) writes a :class:`WorkerEnv` with :meth:`WorkerEnv.to_environ`, and the
worker reads it back with :meth:`WorkerEnv.from_environ` (:func:`multigpu.runtime.world.worker_settings`,
the one reader of ``os.environ``). This module is the one place the ``MULTIGPU_*`` names are spelled.
The rank a launcher that forks its own ranks gives each of them (torch's ``RANK``, ``WORLD_SIZE``,
``MASTER_*``: what torchrun sets for ``multigpu launch``) is written by :class:`WorkerRank`; torch's
reader of them is :mod:`multigpu.runtime.schedulers`.

The environment is outside input (a job script, a user's ``export``): :meth:`WorkerEnv.from_environ`
refuses a malformed value with a :class:`~multigpu.errors.LaunchError` that names the variable, shows
the value and says what to do, and a :class:`WorkerEnv` built with a value it would refuse is refused
too (:class:`~multigpu.errors.ConfigError`), so what one end writes the other reads back.

Example:
    >>> env = WorkerEnv(strategy="ddp", threads=4, debug=True)
    >>> env.to_environ()
    {'MULTIGPU_STRATEGY': 'ddp', 'OMP_NUM_THREADS': '4', 'MULTIGPU_DEBUG': '1'}
    >>> WorkerEnv.from_environ(env.to_environ()) == env
    True
"""

from __future__ import annotations

import math
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from multigpu.core.limits import WEEK_S, seconds_bound
from multigpu.errors import ConfigError, LaunchError
from multigpu.runtime.scheduler_world import shown

PREFIX = "MULTIGPU_"
# torch's own variables, which torchrun (or launch_function, through WorkerRank) sets in every worker
TORCH_WORLD = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
RESTART_COUNT = (
    "TORCHELASTIC_RESTART_COUNT"  # how often the workers were restarted (torchrun, or --fault-tolerant's groups)
)
THREADS = "OMP_NUM_THREADS"

_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")  # a strategy's name: the registry says whether it knows it
_THREADS = re.compile(r"0*[1-9][0-9]{0,5}")  # ASCII digits, few enough for int()
_MAX_THREADS = 999_999
# a launch's run token: the same in every group and restart of one launch; it names a folder (runs/<token>) and a
# tag or param in the trackers' stores, so letters, digits and . _ - only, and short enough for any file system
RUN_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_FIX = "multigpu launch sets it for its workers: unset it, or start the script with multigpu launch"


def _text(name: str, value: str) -> str | None:
    return value or None


def _strategy(name: str, value: str) -> str | None:
    if not value:
        return None
    if not _NAME.fullmatch(value):
        raise LaunchError(f"{shown(name, value)} is not a strategy's name (e.g. ddp, fsdp); {_FIX} --strategy NAME")
    return value


def _flag(name: str, value: str) -> bool:
    if value not in ("", "0", "1"):
        raise LaunchError(f"{shown(name, value)} is not 1 (on) or 0 (off); set it to 1 or 0, or unset it ({_FIX})")
    return value == "1"


def _seconds(name: str, value: str) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value) if value.isascii() else math.nan
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= WEEK_S:  # nan, 0, or inf, which would overflow torch's timer in every worker
        raise LaunchError(
            f"{shown(name, value)} is not a number of seconds > 0 and at most "
            f"{seconds_bound(WEEK_S)}; pass multigpu launch --collective-timeout SECONDS (e.g. 600)"
        )
    return seconds


def _folder(name: str, value: str) -> str | None:
    if not value:
        return None
    if not os.path.isabs(value):  # every rank must find the one folder, whatever its working directory
        raise LaunchError(
            f"{shown(name, value)} is not an absolute path; it is the launch's own temporary folder: {_FIX}"
        )
    return value


def _threads(name: str, value: str) -> int | None:
    # OpenMP's own forms ('4,2', 'false') and the rest are OpenMP's to read: multigpu then picks its count
    return int(value) if _THREADS.fullmatch(value) else None


def _count(minimum: int) -> Callable[[str, str], int | None]:
    def read(name: str, value: str) -> int | None:
        if not value:
            return None
        if not (value.isascii() and value.isdigit()) or len(value) > 6 or int(value) < minimum:
            raise LaunchError(
                f"{shown(name, value)} is not a count >= {minimum}; it is set by "
                "'multigpu launch --fault-tolerant --replicas R': start the script that way"
            )
        return int(value)

    return read


def _pid(name: str, value: str) -> int | None:
    if not value:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 10 or int(value) < 1:
        raise LaunchError(
            f"{shown(name, value)} is not a process id; it is set by 'multigpu launch --fault-tolerant' for the "
            "workers it starts: unset it, or start the script that way"
        )
    return int(value)


def _run_token(name: str, value: str) -> str | None:
    if not value:
        return None
    if not RUN_TOKEN.fullmatch(value):
        raise LaunchError(
            f"{shown(name, value)} is not a run token: 1 to 64 letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit; set it to one (e.g. {name}=digits-lr0.1) to continue that run, or unset it "
            "(multigpu launch then gives the launch a new one)"
        )
    return value


def new_run_token() -> str:
    """A launch's own run token when the user set none: its start time and 8 random hex digits.

    Example:
        >>> RUN_TOKEN.fullmatch(new_run_token()) is not None
        True
    """
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def _write_flag(value: Any) -> str | None:
    return "1" if value else None


def _write(value: Any) -> str | None:
    return None if value is None else str(value)


# field -> (variable, reader, writer); the order is to_environ's
_CODEC: dict[str, tuple[str, Callable[[str, str], Any], Callable[[Any], str | None]]] = {
    "strategy": (PREFIX + "STRATEGY", _strategy, _write),
    "devices": (PREFIX + "DEVICES", _text, _write),
    "threads": (THREADS, _threads, _write),
    "bind_cores": (PREFIX + "BIND_CORES", _flag, _write_flag),
    "collective_timeout_s": (PREFIX + "COLLECTIVE_TIMEOUT", _seconds, _write),
    "failure_dir": (PREFIX + "FAILURE_DIR", _folder, _write),
    "stderr_copy": (PREFIX + "STDERR_COPY", _flag, _write_flag),
    "debug": (PREFIX + "DEBUG", _flag, _write_flag),
    "replica_group": (PREFIX + "REPLICA_GROUP", _count(0), _write),
    "replica_groups": (PREFIX + "REPLICA_GROUPS", _count(1), _write),
    "lighthouse": (PREFIX + "LIGHTHOUSE", _text, _write),
    "supervisor": (PREFIX + "SUPERVISOR", _pid, _write),
    "run_token": (PREFIX + "RUN_ID", _run_token, _write),
}


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """What a launcher asks of its workers (all optional; a plain process has none of it).

    Attributes:
        strategy: ``--strategy`` (``MULTIGPU_STRATEGY``): what ``Session(strategy="auto")`` picks; set in
            the one process of a ``single``/``dp`` launch too, which tells it from a scheduler's task.
        devices: ``--devices`` of ``dp`` (``MULTIGPU_DEVICES``), e.g. ``"cpu:2"``.
        threads: intra-op threads per process (``OMP_NUM_THREADS``); read back only as a plain count.
        bind_cores: bind the worker to its share of the cores (``MULTIGPU_BIND_CORES``).
        collective_timeout_s: seconds a collective waits for a missing rank (``MULTIGPU_COLLECTIVE_TIMEOUT``).
        failure_dir: the absolute folder where each worker records its failure (``MULTIGPU_FAILURE_DIR``).
        stderr_copy: copy the worker's stderr into the failure folder (``MULTIGPU_STDERR_COPY``).
        debug: check every collective on every rank (``MULTIGPU_DEBUG``).
        replica_group: under ``--fault-tolerant``, this worker's replica group, 0..R-1 (``MULTIGPU_REPLICA_GROUP``).
        replica_groups: under ``--fault-tolerant``, how many groups the run has (``MULTIGPU_REPLICA_GROUPS``).
        lighthouse: under ``--fault-tolerant``, the torchft lighthouse the groups meet at
            (``MULTIGPU_LIGHTHOUSE``, ``http://host:port``).
        supervisor: under ``--fault-tolerant``, the pid of the launcher that started this worker, which dies with
            it (``MULTIGPU_SUPERVISOR``; :mod:`multigpu.launcher.die_with_parent`).
        run_token: the launch's run token (``MULTIGPU_RUN_ID``), the same in every replica group and every
            restart of one launch: the Session's trackers continue the run it names
            (:mod:`multigpu.session.trackers`). A user may set it to join a relaunch to the same run.
    """

    strategy: str | None = None
    devices: str | None = None
    threads: int | None = None
    bind_cores: bool = False
    collective_timeout_s: float | None = None
    failure_dir: str | None = None
    stderr_copy: bool = False
    debug: bool = False
    replica_group: int | None = None
    replica_groups: int | None = None
    lighthouse: str | None = None
    supervisor: int | None = None
    run_token: str | None = None

    def __post_init__(self) -> None:
        # what from_environ would refuse, or read back as something else, is refused here, by field
        for attribute in ("bind_cores", "stderr_copy", "debug"):
            if not isinstance(getattr(self, attribute), bool):
                raise ConfigError(f"WorkerEnv({attribute}={getattr(self, attribute)!r}): pass True or False")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or not 1 <= self.threads <= _MAX_THREADS
        ):
            raise ConfigError(f"WorkerEnv(threads={self.threads!r}): pass a thread count from 1 to {_MAX_THREADS}")
        timeout = self.collective_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise ConfigError(f"WorkerEnv(collective_timeout_s={timeout!r}): pass seconds as a number, or None")
        for attribute in ("replica_group", "replica_groups", "supervisor"):
            value = getattr(self, attribute)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"WorkerEnv({attribute}={value!r}): pass a count, or None")
        for attribute in ("strategy", "devices", "failure_dir", "lighthouse", "run_token"):
            value = getattr(self, attribute)
            if value is not None and (not isinstance(value, str) or not value or "\0" in value):
                raise ConfigError(f"WorkerEnv({attribute}={value!r}): pass a non-empty string without NUL, or None")
        try:
            WorkerEnv._read(self.to_environ())
        except LaunchError as exc:
            raise ConfigError(f"WorkerEnv: {exc}") from None

    def to_environ(self) -> dict[str, str]:
        """The variables that say this (unset fields are left out, so the worker reads their defaults)."""
        out = {}
        for attribute, (name, _, write) in _CODEC.items():
            text = write(getattr(self, attribute))
            if text is not None:
                out[name] = text
        return out

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> WorkerEnv:
        """What ``environ`` says (missing variables: the defaults).

        Raises:
            LaunchError: a variable that does not parse, named with its value and the fix.
        """
        return cls(**cls._read(environ))

    @staticmethod
    def _read(environ: Mapping[str, str]) -> dict[str, Any]:
        return {attribute: read(name, environ.get(name, "")) for attribute, (name, read, _) in _CODEC.items()}

    @staticmethod
    def variable(attribute: str) -> str:
        """The variable that carries ``attribute``, for a message or a check of a process's environment.

        Example:
            >>> WorkerEnv.variable("failure_dir")
            'MULTIGPU_FAILURE_DIR'
        """
        return _CODEC[attribute][0]

    @staticmethod
    def variables() -> tuple[str, ...]:
        """multigpu's own variables of the codec (not ``OMP_NUM_THREADS``, which is also the user's).

        Example:
            >>> "MULTIGPU_DEBUG" in WorkerEnv.variables(), "OMP_NUM_THREADS" in WorkerEnv.variables()
            (True, False)
        """
        return tuple(name for name, _, _ in _CODEC.values() if name.startswith(PREFIX))

    @staticmethod
    def read(environ: Mapping[str, str], attribute: str) -> Any:
        """One field of ``environ``, the others unread (where one malformed variable must not stop another's use)."""
        name, read, _ = _CODEC[attribute]
        return read(name, environ.get(name, ""))


assert [f.name for f in fields(WorkerEnv)] == list(_CODEC), "every field has its variable"


@dataclass(frozen=True, kw_only=True)
class WorkerRank:
    """One rank's place in a world a launcher forms itself (:func:`~multigpu.launcher.function.launch_function`;
    torchrun sets the same variables for ``multigpu launch``).

    Attributes:
        rank: its global rank; local_rank: its rank on this node; world_size / local_world_size: the counts.
        master_addr, master_port: the rendezvous store's address.
        agent_store: the store is hosted by the launcher (``TORCHELASTIC_USE_AGENT_STORE``), not by rank 0.
        restarts: how often this rank's workers were started again (``TORCHELASTIC_RESTART_COUNT``).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool = False
    restarts: int = 0

    def __post_init__(self) -> None:
        counts = (self.rank, self.local_rank, self.world_size, self.local_world_size, self.master_port, self.restarts)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts) or not (
            self.rank < self.world_size and self.local_rank < self.local_world_size and 0 < self.master_port < 65536
        ):
            raise ConfigError(
                f"{self!r}: ranks must be below their world sizes, the counts >= 0 and the port in 1..65535"
            )

    def to_environ(self) -> dict[str, str]:
        values = (
            self.rank,
            self.local_rank,
            self.world_size,
            self.local_world_size,
            self.master_addr,
            self.master_port,
        )
        out = {name: str(value) for name, value in zip(TORCH_WORLD, values)}
        if self.agent_store:
            out[AGENT_STORE] = "True"  # rank 0 connects to the launcher's store instead of hosting one
        if self.restarts:
            out[RESTART_COUNT] = str(self.restarts)
        return out


def owned_variable(name: str) -> bool:
    """Whether every launch sets ``name`` itself in its workers (a user's extra variable may not).

    Example:
        >>> owned_variable("MULTIGPU_DEBUG"), owned_variable("RANK"), owned_variable("NCCL_DEBUG")
        (True, True, False)
    """
    return name.startswith(PREFIX) or name in TORCH_WORLD or name == AGENT_STORE
