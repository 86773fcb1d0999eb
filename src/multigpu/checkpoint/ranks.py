"""What each rank does in a checkpoint: the main process writes, every rank keeps its own random state.

Inside a process group of several ranks rank 0 writes and the others wait (:func:`run_on_main`),
and a check every rank makes fails on every rank if it fails on one (:func:`agreed`), so no rank is
left waiting; outside one, nothing here communicates and the main process writes alone.

Each rank has its own random state (under a Session they differ per rank after ``setup_model``):
:func:`capture_rng` takes it as tensors, ints and tuples only, so ``state.pt`` loads with
``torch.load(weights_only=True)``; a save gathers every rank's on the main process and resume gives
each rank its own back. The accelerators' generators are read and set by their device objects
(:func:`multigpu.devices.capture_device_rng`), one entry per type name (``"cuda"``: a state per
CUDA device), so a checkpoint written before there were device objects restores unchanged.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from multigpu.devices import capture_device_rng, device_type_names, restore_device_rng
from multigpu.errors import CheckpointError
from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.collectives import issuing
from multigpu.runtime.world import in_process_group, is_main_process, world_size

T = TypeVar("T")
_thread = threading.local()  # .group: the process group of this thread's checkpoint collectives


@contextlib.contextmanager
def on_group(group: Any) -> Iterator[None]:
    """This thread's checkpoint collectives (here and DCP's) go over ``group`` instead of the default group.

    For a write in the background (:mod:`background`): its collectives must not interleave with the
    training loop's on the default group. ``group`` spans every rank, so its rank 0 is rank 0. They
    stay outside :func:`~multigpu.runtime.collectives.issuing` (the ledger and ``--debug``'s check
    follow the training loop's order, which a background thread does not keep); failures are still
    explained.
    """
    _thread.group = group
    try:
        yield
    finally:
        _thread.group = None


def thread_group() -> Any:
    """The process group this thread's checkpoint collectives use (``None``: the default group)."""
    return getattr(_thread, "group", None)


def _door(what: str) -> contextlib.AbstractContextManager[None]:
    return issuing(what) if thread_group() is None else explain_collective_failures(what)


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
    with _door(f"waiting for rank 0 to finish {what}"):
        dist.broadcast_object_list(message, src=0, group=thread_group())
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
    with _door(f"gathering {what} on rank 0"):
        dist.gather_object(obj, gathered, dst=0, group=thread_group())
    return gathered


def agreed(compute: Callable[[], T], what: str) -> T:
    """``compute()`` on every rank; if it fails on any rank, every rank raises (the first failing rank's error).

    Every rank must call this. Without a process group it is ``compute()``.
    """
    if not is_distributed():
        return compute()
    failure: BaseException | None = None
    result: Any = None
    try:
        result = compute()
    except Exception as exc:
        failure = exc
    problems: list[Any] = [None] * world_size()
    with _door(what):
        dist.all_gather_object(
            problems, None if failure is None else f"{type(failure).__name__}: {failure}", group=thread_group()
        )
    if failure is not None:
        raise failure
    for rank, problem in enumerate(problems):
        if problem is not None:
            raise CheckpointError(f"rank {rank} refused the checkpoint, so every rank stops: {problem}")
    return result  # type: ignore[no-any-return]


# --- every rank's random state ---


def capture_rng() -> dict[str, Any]:
    """The random state of this process.

    Example:
        >>> state = capture_rng(); a = torch.rand(1); restore_rng(state); bool(torch.rand(1) == a)
        True
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    state.update(capture_device_rng())  # {"cuda": [state of cuda:0, ...]} where CUDA is available
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put this process's random generators back to ``state`` (from :func:`capture_rng`).

    An accelerator's states are restored only where as many devices of its type are visible as
    when they were saved (a run resumed on other hardware keeps its fresh generators).
    """
    random.setstate(_as_python_state(state["python"]))
    saved = state["numpy"]
    keys = saved["keys"].numpy().astype(np.uint32)
    np.random.set_state((saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    restore_device_rng({name: state[name] for name in device_rng_keys() if name in state})


def device_rng_keys() -> tuple[str, ...]:
    """The entries of a random state that may hold accelerators' generators: the registered types but the CPU.

    Example:
        >>> "cuda" in device_rng_keys(), "cpu" in device_rng_keys()
        (True, False)
    """
    return tuple(name for name in device_type_names() if name != "cpu")


def _as_python_state(saved: Any) -> tuple[Any, ...]:
    # random.setstate wants tuples; a round trip through some serializers turns them into lists.
    version, internal, gauss = saved
    return (int(version), tuple(int(x) for x in internal), gauss)
