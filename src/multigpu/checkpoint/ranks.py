"""Rank discipline for checkpoints: the main process writes, every other rank waits for it.

Rank and world size come from ``torch.distributed`` when a process group is initialized (the
distributed runtime reads the environment once and creates the group); without a group this
process is the main process of a world of one and nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from multigpu.distributed.failures import explain_collective_failures
from multigpu.errors import CheckpointError

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def global_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Number of processes in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """Whether this process is global rank 0, the one that writes checkpoints."""
    return global_rank() == 0


def run_on_main(write: Callable[[], T], what: str) -> T | None:
    """Run ``write`` on the main process only; every rank returns once it has finished.

    Every rank must call this. If the main process fails, it re-raises its error and every
    other rank raises :class:`CheckpointError` with the main process's message, so no rank
    goes on believing a checkpoint exists.

    Returns:
        ``write()``'s result on the main process, ``None`` elsewhere.
    """
    if not is_distributed():
        return write()
    result: T | None = None
    failure: BaseException | None = None
    if is_main_process():
        try:
            result = write()
        except Exception as exc:
            failure = exc
    status: list[Any] = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    # Sync point: the other ranks wait here until the main process has written (or failed).
    with explain_collective_failures(f"waiting for rank 0 to finish {what}"):
        dist.broadcast_object_list(status, src=0)
    if failure is not None:
        raise failure
    if status[0] is not None:
        raise CheckpointError(f"rank 0 failed {what}, so no checkpoint was written: {status[0]}")
    return result


def gather_on_main(obj: Any, what: str) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on the main process (``None`` elsewhere).

    Every rank must call this. Without a process group it returns ``[obj]``.
    """
    if not is_distributed():
        return [obj]
    gathered: list[Any] | None = [None] * world_size() if is_main_process() else None
    with explain_collective_failures(f"gathering {what} on rank 0"):
        dist.gather_object(obj, gathered, dst=0)
    return gathered
