"""Rank discipline for checkpoints: the main process writes, every other rank waits for it.

Which rank this is, whether a process group is up and which process is the main one are
answered by :mod:`multigpu.runtime.world`, as everywhere else. Inside a process group of
several ranks rank 0 writes and the others wait; outside one, nothing here communicates and the
main process (every process not started by a launcher) writes alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from multigpu.errors import CheckpointError
from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.world import in_process_group, is_main_process, world_size

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a process group with more than one rank is up (checkpoint writes then need collectives)."""
    return in_process_group() and world_size() > 1


def run_on_main(write: Callable[[], T], what: str) -> T | None:
    """Run ``write`` on the main process only; every rank returns once it has finished.

    Every rank must call this. If the main process fails, it re-raises its error and every
    other rank raises :class:`CheckpointError` with the main process's message, so no rank
    goes on believing a checkpoint exists. Without a process group there is nobody to wait
    for: the main process writes, and a launched rank other than 0 returns at once.

    Returns:
        ``write()``'s result on the main process, ``None`` elsewhere.
    """
    if not is_distributed():
        return write() if is_main_process() else None
    return _from_main(write, what, share=False)


def shared_from_main(compute: Callable[[], T], what: str) -> T:
    """``compute()`` run on the main process and its result given to every rank.

    Every rank must call this; failures behave as in :func:`run_on_main`. Without a process
    group every process computes it itself.
    """
    if not is_distributed():
        return compute()
    return _from_main(compute, what, share=True)  # type: ignore[return-value]


def _from_main(compute: Callable[[], T], what: str, *, share: bool) -> T | None:
    result: T | None = None
    failure: BaseException | None = None
    if is_main_process():
        try:
            result = compute()
        except Exception as exc:
            failure = exc
    message: list[Any] = [
        result if share else None,
        None if failure is None else f"{type(failure).__name__}: {failure}",
    ]
    # Sync point: the other ranks wait here until the main process has finished (or failed).
    with explain_collective_failures(f"waiting for rank 0 to finish {what}"):
        dist.broadcast_object_list(message, src=0)
    if failure is not None:
        raise failure
    if message[1] is not None:
        raise CheckpointError(f"rank 0 failed {what}, so no checkpoint was written: {message[1]}")
    return result if is_main_process() else message[0]


def gather_on_main(obj: Any, what: str) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on the main process (``None`` elsewhere).

    Every rank must call this. Without a process group: ``[obj]`` on the main process.
    """
    if not is_distributed():
        return [obj] if is_main_process() else None
    gathered: list[Any] | None = [None] * world_size() if is_main_process() else None
    with explain_collective_failures(f"gathering {what} on rank 0"):
        dist.gather_object(obj, gathered, dst=0)
    return gathered
