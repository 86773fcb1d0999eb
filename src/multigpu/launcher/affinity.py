"""Core binding: each CPU ddp worker runs on its own share of the node's cores.

``multigpu launch --strategy ddp`` on a machine without GPUs gives every worker
``OMP_NUM_THREADS = cores / processes``. Left unbound, the kernel still migrates each worker's
threads (its compute, gloo's I/O) across all cores, where they meet the other workers' threads.
Binding worker ``i`` to the ``i``-th contiguous slice of the cores keeps its caches warm and its
threads off the others' cores. On the 2-core test machine, two gloo workers ran a DDP step about
6% faster bound than unbound (5 alternating repeats; see the README). CPU launchers that tune
for throughput bind by default too.

The launcher asks for it with ``MULTIGPU_BIND_CORES=1`` (see :func:`multigpu.runtime.world.bind_cores_requested`);
the worker entry point binds before the script starts any thread.
"""

from __future__ import annotations

import os
from collections.abc import Collection


def core_share(cores: Collection[int], local_rank: int, local_world_size: int) -> set[int] | None:
    """The cores of process ``local_rank`` of ``local_world_size``: a contiguous, equal slice.

    Returns None when there are fewer cores than processes (nothing to split). Cores left over
    by an uneven division stay unused by the binding rather than crowding one process.

    Example:
        >>> core_share(range(8), local_rank=1, local_world_size=2)
        {4, 5, 6, 7}
        >>> core_share({0, 1}, local_rank=0, local_world_size=4) is None
        True
    """
    ordered = sorted(cores)
    per = len(ordered) // local_world_size
    if per == 0 or not 0 <= local_rank < local_world_size:
        return None
    return set(ordered[local_rank * per : (local_rank + 1) * per])


def bind_to_core_share(local_rank: int, local_world_size: int) -> set[int] | None:
    """Restrict this process (and the threads it starts later) to its :func:`core_share`.

    Returns the cores bound to, or None where it cannot bind (no ``sched_setaffinity`` on this
    platform, or fewer cores than processes): then the process runs unbound, as before.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    share = core_share(os.sched_getaffinity(0), local_rank, local_world_size)
    if share is not None:
        os.sched_setaffinity(0, share)
    return share
