"""Signal a peer worker of this run only when it provably is one.

A rank whose collective timed out asks the other ranks of its node for their stacks by signalling the
process ids their ledgers name (:func:`multigpu.runtime.tracking.request_peer_stacks`). A ledger is a
file: one left by a worker that has exited names a pid the system may since have given to anyone, and
one that is garbage may name 0 (our own process group), -1 (every process we may signal: as root, the
whole machine) or a negative number (a process group). So the signal goes only to a process that
proves, on Linux, that it is the worker the ledger describes:

- its pid is a positive number other than 1 and other than this process's;
- its start time (``/proc/<pid>/stat``, clock ticks after boot) is the one its ledger recorded
  (:func:`start_time`, written by the worker itself): a reused pid started later;
- its environment, as it started (``/proc/<pid>/environ``), holds this run's failure folder (a fresh
  temporary folder per launch) and the ledger's rank: a process of another run or none does not.

The process is pinned first (``pidfd_open``) and the signal goes through that descriptor, so a pid
reused between the check and the signal cannot receive it. Without ``/proc`` (not Linux) nothing is
provable and nothing is signalled: the summary then goes without the peers' stacks.
"""

from __future__ import annotations

import contextlib
import os
import signal

from multigpu.core.run_files import UnreadableFile, read_bytes
from multigpu.runtime.worker_env import WorkerEnv

_ENVIRON_BYTES = 1 << 20  # the kernel passes at most a few MiB; a worker's is a few KiB


def start_time(pid: int | None = None) -> int:
    """When process ``pid`` (None: this one) started, in clock ticks after boot; 0 when unknown (not Linux)."""
    try:
        text = read_bytes(f"/proc/{'self' if pid is None else pid}/stat", limit=4096).decode(errors="replace")
        # field 2 (the command) is in parentheses and may hold anything: count the fields after its end
        return int(text.rsplit(")", 1)[1].split()[19])
    except (UnreadableFile, IndexError, ValueError):
        return 0


def signal_peer(pid: int, signum: int, *, rank: int, start: int, run_dir: str) -> bool:
    """Send ``signum`` to ``pid`` if it is rank ``rank``'s worker of the run whose failure folder is ``run_dir``.

    ``start`` is the start time the worker recorded (:func:`start_time`). Returns whether the signal was
    sent; a process that cannot be proven to be that worker (see the module docstring) is left alone.
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or not 1 < pid < 2**31 or pid == os.getpid() or start <= 0:
        return False
    try:
        pinned = os.pidfd_open(pid)
    except AttributeError:  # not Linux: no pidfd, and no /proc to prove anything with
        return False
    except OSError:  # gone already, or (an old kernel) no pidfd: checked below just before the signal
        pinned = -1
    try:
        if not _is_worker(pid, rank=rank, start=start, run_dir=run_dir):
            return False
        if pinned >= 0:
            signal.pidfd_send_signal(pinned, signum)
        elif start_time(pid) == start:
            os.kill(pid, signum)
        else:
            return False
        return True
    except OSError:  # gone meanwhile, or not ours to signal
        return False
    finally:
        if pinned >= 0:
            os.close(pinned)


def signal_group(pgid: int, signum: int, *, start: int, argument: str) -> bool:
    """Send ``signum`` to the process group ``pgid`` if it is provably the one a worker of ours leads.

    The worker recorded its pid (its group's id: it leads a session of its own) and :func:`start_time`;
    ``argument`` is one its command line holds (a path unique to the run). The group is ours when its
    leader still runs with that start time and argument, or, the leader gone, when a member still runs
    with that argument (a group's id is not given to another process while any member lives). Returns
    whether the signal was sent; pid 0, 1, -1, negative numbers and this process's own group never are.
    """
    if not isinstance(pgid, int) or isinstance(pgid, bool) or not 1 < pgid < 2**31 or pgid == os.getpgrp():
        return False
    leader = start > 0 and start_time(pgid) == start and argument in _arguments(pgid)
    if not leader and not any(argument in _arguments(pid) for pid in _members(pgid)):
        return False
    try:
        os.killpg(pgid, signum)
    except OSError:  # gone meanwhile
        return False
    return True


def _arguments(pid: int) -> list[str]:
    try:
        raw = read_bytes(f"/proc/{pid}/cmdline", limit=_ENVIRON_BYTES)
    except UnreadableFile:
        return []
    return raw.decode(errors="replace").split("\0")


def _members(pgid: int) -> list[int]:
    """The running processes of group ``pgid`` ([] without ``/proc``)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(UnreadableFile, IndexError, ValueError):
                fields = read_bytes(f"/proc/{entry.name}/stat", limit=4096).decode(errors="replace").rsplit(")", 1)[1]
                state, _, group = fields.split()[:3]
                if int(group) == pgid and state != "Z":
                    found.append(int(entry.name))
    return found


def _is_worker(pid: int, *, rank: int, start: int, run_dir: str) -> bool:
    if start_time(pid) != start:
        return False
    with contextlib.suppress(UnreadableFile):
        environ = read_bytes(f"/proc/{pid}/environ", limit=_ENVIRON_BYTES).split(b"\0")
        told = {**WorkerEnv(failure_dir=run_dir).to_environ(), "RANK": str(rank)}  # what its launcher told it
        wanted = {f"{name}={value}".encode() for name, value in told.items()}
        return wanted <= set(environ)
    return False
