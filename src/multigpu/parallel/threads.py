"""Run one function per replica in parallel threads, with the caller's autograd and autocast state.

Threads start with default thread-local state: grad mode on and autocast off. Each task
re-enters the caller's grad mode and autocast (enabled flag *and* dtype) for its device type,
so ``torch.no_grad()`` and ``torch.autocast(..., dtype=torch.bfloat16)`` around the model call
reach every replica. Replica 0 runs on the calling thread; the others on a shared pool of
long-lived threads (starting threads every step would cost more than small models compute).

An exception in a replica is re-raised in the caller with the replica index and device in its
message and the replica's traceback attached.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from multigpu.devices import ReplicaDevice
from multigpu.profiling.memory import replica_scope

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


@dataclass(frozen=True)
class ThreadState:
    """The thread-local autograd and autocast settings a replica thread must re-enter."""

    grad_enabled: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]

    @staticmethod
    def capture(device_types: Sequence[str]) -> ThreadState:
        autocast = tuple(
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in dict.fromkeys(device_types)
        )
        return ThreadState(torch.is_grad_enabled(), autocast)

    @contextlib.contextmanager
    def entered(self) -> Any:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for kind, enabled, dtype in self.autocast:
                if enabled:
                    stack.enter_context(torch.autocast(kind, dtype=dtype))
            yield


def parallel_apply(fn: Callable[[int], T], devices: Sequence[ReplicaDevice], *, what: str = "forward") -> list[T]:
    """Call ``fn(i)`` for every replica i, in parallel, and return the results in order.

    Args:
        fn: the work of replica i; it runs inside the caller's grad mode and autocast state.
        devices: the devices of the replicas (``len(devices)`` calls are made).
        what: the phase, named in error messages ("forward", "backward").

    Raises:
        The replica's own exception type (when it can be rebuilt with a message) naming the
        replica and device, chained to the original exception.
    """
    state = ThreadState.capture([d.type for d in devices])
    if len(devices) == 1:
        with _device_context(devices[0].device), replica_scope(devices[0]):
            return [_run_named(fn, 0, devices[0], what)]

    def task(i: int) -> T:
        with state.entered(), _device_context(devices[i].device), replica_scope(devices[i]):
            return fn(i)

    # CPU replicas share the process's intra-op pool (torch.set_num_threads is process-wide).
    # Re-dividing it per step was measured slower than leaving it alone: resizing the pool
    # costs more than the brief oversubscription (benchmarks/step_time.py).
    return _run_all(task, devices, what)


def _run_all(task: Callable[[int], T], devices: Sequence[ReplicaDevice], what: str) -> list[T]:
    pool = _get_pool(len(devices) - 1)
    futures: list[Future[T]] = [pool.submit(_run_named, task, i, devices[i], what) for i in range(1, len(devices))]
    results: list[Any] = [None] * len(devices)
    first_error: BaseException | None = None
    try:
        results[0] = _run_named(task, 0, devices[0], what)
    except BaseException as exc:  # still wait for the other replicas: no thread is left running
        first_error = exc
    for i, future in enumerate(futures, start=1):
        try:
            results[i] = future.result()
        except BaseException as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return results


def _run_named(task: Callable[[int], T], i: int, device: ReplicaDevice, what: str) -> T:
    try:
        return task(i)
    except Exception as exc:
        raise _named_error(exc, i, device, what) from exc


def _named_error(exc: Exception, i: int, device: ReplicaDevice, what: str) -> Exception:
    detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = f"Caught {type(exc).__name__} in replica {i} on device {device.label} during {what}.\n{detail}"
    try:
        return type(exc)(message)
    except Exception:  # exception types whose constructor takes other arguments
        return RuntimeError(message)


def _device_context(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="multigpu-replica")
            _pool_size = workers
        return _pool
