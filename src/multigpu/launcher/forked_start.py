"""What a forked rank can still apply of the variables other processes read only when they start.

A rank of :func:`~multigpu.launcher.function.launch_function` is forked from the caller, not started:
it gets the launch's variables in ``os.environ``, but what its libraries read at start-up was read when
the caller started. Setting the variable alone would only hide that (fsdp's warning about a process
without its malloc settings reads the environment), so :func:`apply_after_fork` applies what a running
process can still change:

- ``GLIBC_TUNABLES``' malloc settings that ``mallopt`` takes (the mmap threshold fsdp on the CPU asks for,
  :meth:`~multigpu.devices.base.DeviceType.sharded_process_env`: the memory it saves comes from it);
  ``glibc.malloc.hugetlb`` has no ``mallopt`` and stays the caller's (it makes mapping cheaper, not
  memory smaller);
- ``OMP_NUM_THREADS``, when torch is already imported (its intra-op pool was sized in the caller, to the
  whole machine): ``torch.set_num_threads`` with the rank's share, so the ranks do not oversubscribe the cores.
"""

from __future__ import annotations

import ctypes
import platform
import sys
from collections.abc import Mapping

from multigpu.runtime.worker_env import WorkerEnv

# glibc's tunables that mallopt also sets (malloc.h's M_* parameters)
_MALLOPT = {
    "glibc.malloc.trim_threshold": -1,  # M_TRIM_THRESHOLD
    "glibc.malloc.top_pad": -2,  # M_TOP_PAD
    "glibc.malloc.mmap_threshold": -3,  # M_MMAP_THRESHOLD
    "glibc.malloc.mmap_max": -4,  # M_MMAP_MAX
    "glibc.malloc.arena_test": -7,  # M_ARENA_TEST
    "glibc.malloc.arena_max": -8,  # M_ARENA_MAX
}


def apply_after_fork(environ: Mapping[str, str]) -> list[str]:
    """Apply ``environ``'s start-time settings to this (forked) process; returns the ``name=value`` settings applied.

    Example:
        >>> apply_after_fork({})
        []
    """
    applied = _apply_malloc(environ.get("GLIBC_TUNABLES", ""))
    threads = WorkerEnv.read(environ, "threads")
    torch = sys.modules.get("torch")
    if threads is not None and torch is not None:  # not imported yet: it reads OMP_NUM_THREADS when it is
        torch.set_num_threads(threads)
        applied.append(f"torch.set_num_threads={threads}")
    return applied


def _apply_malloc(tunables: str) -> list[str]:
    settings = [item.partition("=") for item in tunables.split(":") if item]
    wanted = [(name, value) for name, _, value in settings if name in _MALLOPT and value.isascii() and value.isdigit()]
    if not wanted or platform.libc_ver()[0] != "glibc":
        return []
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = []
    for name, value in wanted:
        if int(value) < 2**31 and mallopt(_MALLOPT[name], int(value)) == 1:  # 1: glibc took it
            applied.append(f"{name}={value}")
    return applied
