"""The world a scheduler's variables describe, and the readers every scheduler's variables share.

:mod:`multigpu.runtime.schedulers` (SLURM, a PyTorchJob pod, the dispatch), :mod:`multigpu.runtime.mpi_env`
(Open MPI, MPICH) and :mod:`multigpu.runtime.world` (torchrun's ``RANK``/``WORLD_SIZE``) build a
:class:`SchedulerWorld` from what these readers accept; a count, a port or a host that does not parse
is refused by name, showing the value (cut short when long) and the fix.

A count is ASCII decimal digits, nothing else (no sign, space, ``_`` or other scripts' digits, which
Python's ``int`` would take), at most :data:`MAX_WORLD`: torch.distributed's ranks are C ints, so no
run has more processes (or nodes) than that, and nothing is ever built that many times over.

Example:
    >>> read_ints({"SLURM_PROCID": "3"}, ["SLURM_PROCID"], "start it with srun")
    [3]
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from multigpu.errors import LaunchError

DEFAULT_PORT = 29500  # torch.distributed's MASTER_PORT when none is set; every part of multigpu names it here
MAX_WORLD = 2**31 - 1  # torch.distributed's ranks and world sizes are C ints
_MAX_DIGITS = len(str(MAX_WORLD))
_SHOWN = 60  # characters of a value a message shows


@dataclass(frozen=True)
class SchedulerWorld:
    """The world a scheduler's variables describe, for one process (or, for the launcher, one node).

    Attributes:
        scheduler: ``slurm``, ``openmpi``, ``mpich`` or ``torchrun``.
        global_rank: this process's rank among all.
        local_rank: its rank on its node.
        world_size: processes in the run.
        local_world_size: processes on this node.
        node_rank: this node's rank; None when the variables do not say it (MPI on several nodes).
        master_addr: where rank 0's store listens.
        master_port: its port.
    """

    scheduler: str
    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int | None
    master_addr: str
    master_port: int


def shown(name: str, value: str) -> str:
    """``NAME='value'`` for a message, the value cut to its first characters when long.

    Example:
        >>> shown("SLURM_NTASKS", "9" * 100)
        "SLURM_NTASKS='999999999999999999999999999999999999999999999999999999999999'... (100 characters)"
    """
    if len(value) <= _SHOWN:
        return f"{name}={value!r}"
    return f"{name}={value[:_SHOWN]!r}... ({len(value)} characters)"


def parse_count(name: str, value: str, fix: str) -> int:
    """``value`` of variable ``name`` as a count or index in 0..:data:`MAX_WORLD`.

    Raises:
        LaunchError: naming the variable, its value and ``fix``, for anything but ASCII decimal digits
            (a sign, a space, another script's digits) or a number above :data:`MAX_WORLD`.
    """
    if re.fullmatch(r"[0-9]+", value) is None:
        raise LaunchError(f"{shown(name, value)} is not a count or index (decimal digits, e.g. 4); {fix}")
    digits = value.lstrip("0") or "0"
    if len(digits) > _MAX_DIGITS or int(digits) > MAX_WORLD:  # int() of thousands of digits raises
        raise LaunchError(
            f"{shown(name, value)} is above {MAX_WORLD}, the most processes torch.distributed can count; {fix}"
        )
    return int(digits)


def read_ints(env: Mapping[str, str], names: list[str], fix: str) -> list[int]:
    """The variables ``names`` as counts or indexes (:func:`parse_count`); unset ones are refused by name."""
    return [parse_count(name, env.get(name, ""), fix) for name in names]


def read_port(env: Mapping[str, str], name: str = "MASTER_PORT") -> int:
    """``name`` (``MASTER_PORT``; :data:`DEFAULT_PORT` when unset) as a TCP port; a LaunchError when it is not one."""
    value = env.get(name, str(DEFAULT_PORT))
    fix = f"set {name} to a TCP port in 1..65535, the same on every process"
    if re.fullmatch(r"[0-9]{1,5}", value) is None or not 0 < int(value) < 65536:
        raise LaunchError(f"{shown(name, value)} is not a TCP port; {fix}")
    return int(value)


def read_addr(env: Mapping[str, str], name: str = "MASTER_ADDR") -> str | None:
    """``name`` (``MASTER_ADDR``) as a host name or IP address, or None when unset.

    Raises:
        LaunchError: an empty value, or one with spaces, control characters or non-ASCII letters (a
            host name is ASCII: write an international one in its ``xn--`` form), or longer than 255.
    """
    if name not in env:
        return None
    value = env[name]
    if re.fullmatch(r"[!-~]{1,255}", value) is None:  # printable ASCII, no space
        raise LaunchError(
            f"{shown(name, value)} is not a host name or IP address; set it to rank 0's host (e.g. "
            f"{name}=node01 or 10.0.0.1), the same on every process, or unset it"
        )
    return value
