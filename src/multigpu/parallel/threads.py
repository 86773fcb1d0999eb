"""Run one function per replica in parallel threads, with the caller's autograd and autocast state.

Threads start with default thread-local state: grad mode on, autocast off, each device's default
stream. Each task re-enters the caller's grad mode and autocast (enabled flag *and* dtype) for its
device type, so ``torch.no_grad()`` and ``torch.autocast(..., dtype=torch.bfloat16)`` around the
model call reach every replica, and the caller's current stream of its device (where the caller
queued the copies of its inputs), as torch's ``parallel_apply`` does. Replica 0 runs on the calling
thread and the others on the worker threads of a :class:`ReplicaThreads` pool that the caller owns
(each DataParallel owns one; starting threads every step would cost more than small models compute).

Where the device type divides the caller's intra-op threads among its replicas
(``DeviceType.replica_intra_op_threads``: the CPU's replicas share its cores), every replica runs on
a worker that computes with its share, and the caller only waits; under ``torch.profiler`` replica 0
still runs on the caller, the thread the profiler records.

The pool never makes a task wait for a free worker: when every worker is busy it starts another.
That is what lets a DataParallel run inside a replica of another one (a teacher model called in the
student's forward, a DataParallel nested in a wrapped model) without deadlock: the outer step's
workers wait on the inner step's, which run on threads of their own.

An exception in a replica is re-raised in the caller with the replica index and device in its
message and the replica's traceback attached (torch's ``ExceptionWrapper``, which keeps the
message of a ``KeyError`` readable).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch._utils import ExceptionWrapper

from multigpu.core.listeners import Listeners
from multigpu.devices import ReplicaDevice, get_device_type

T = TypeVar("T")

_Task = tuple[Callable[[], Any], "Future[Any]"]


class ReplicaThreads:
    """Worker threads for replicas, owned by one object (a DataParallel) and ended by :meth:`close`.

    Workers are started on demand and kept while idle, so a steady training loop reuses the same
    threads every step; a task submitted while every worker is busy gets a new one, never a wait.
    After :meth:`close` the pool still runs what it is given, on threads that end after their task.

    Example:
        >>> threads = ReplicaThreads()
        >>> threads.submit(lambda: 2 + 2).result()
        4
        >>> threads.close()
    """

    def __init__(self, name: str = "multigpu-replica") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._idle: list[tuple[int, queue.SimpleQueue[_Task | None]]] = []  # (home slot, inbox)
        self._threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._closed = False

    def submit(self, fn: Callable[[], T], slot: int = 0) -> Future[T]:
        """Run ``fn`` on an idle worker of ``slot``, or on a new one when none is idle.

        ``slot`` (a replica's index) is the worker's home: a worker runs only its own slot's tasks, so
        a loop runs each replica on the same thread every step (its intra-op count, its caches).
        """
        future: Future[T] = Future()
        with self._lock:
            inbox = self._take_idle(slot)
        if inbox is None:
            inbox = queue.SimpleQueue()
            thread = threading.Thread(
                target=_work,
                args=(inbox, slot, weakref.ref(self)),
                name=f"{self.name}-{len(self._threads)}",
                daemon=True,
            )
            self._threads.add(thread)
            thread.start()
        inbox.put((fn, future))
        return future

    def threads(self) -> list[threading.Thread]:
        """The worker threads still alive (idle or busy)."""
        return [t for t in list(self._threads) if t.is_alive()]

    def close(self, timeout_s: float = 5.0) -> None:
        """End the idle workers (waiting up to ``timeout_s`` for them); busy ones end after their task."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for _, inbox in idle:
            inbox.put(None)
        for thread in self.threads():
            if thread is not threading.current_thread():
                thread.join(timeout_s)

    def _take_idle(self, slot: int) -> queue.SimpleQueue[_Task | None] | None:
        """An idle worker whose home is ``slot``, else None: a new one (under the lock).

        Never another slot's worker: replica 0's worker, done with a small step before replica 2 was
        submitted, would otherwise run replica 2 too, and a replica would change threads between steps.
        """
        for k, (home, _) in enumerate(self._idle):
            if home == slot:
                return self._idle.pop(k)[1]
        return None

    def _take_back(self, inbox: queue.SimpleQueue[_Task | None], slot: int) -> bool:
        """A worker finished its task: keep it idle (True) or let it end (False, after close)."""
        with self._lock:
            if self._closed:
                return False
            self._idle.append((slot, inbox))
            return True

    def __deepcopy__(self, memo: dict[int, Any]) -> ReplicaThreads:
        return ReplicaThreads(self.name)  # a copy of the owner gets its own workers

    def __reduce__(self) -> tuple[type[ReplicaThreads], tuple[str]]:
        return (ReplicaThreads, (self.name,))


def _work(inbox: queue.SimpleQueue[_Task | None], slot: int, pool: weakref.ref[ReplicaThreads]) -> None:
    # Holds the pool weakly: an owner that is garbage-collected without close() still frees it.
    _local.replica = True
    while True:
        task = inbox.get()
        if task is None:
            return
        fn, future = task
        del task
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
        del fn, future  # drop the result and the task's references before waiting again
        owner = pool()
        if owner is None or not owner._take_back(inbox, slot):
            return
        del owner


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
            if torch.amp.is_autocast_available(kind)  # a registered type may be one autocast does not know
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


def run_replicas(
    fn: Callable[[int], T],
    devices: Sequence[ReplicaDevice],
    threads: ReplicaThreads,
    *,
    what: str = "forward",
    listeners: Listeners | None = None,
) -> list[T]:
    """Call ``fn(i)`` for every replica i, in parallel, and return the results in order.

    Args:
        fn: the work of replica i; it runs inside the caller's grad mode and autocast state.
        devices: the devices of the replicas (``len(devices)`` calls are made).
        threads: the pool the replicas other than the first run on.
        what: the phase, named in error messages ("forward", "backward").
        listeners: the owner's listeners; each replica's work runs inside their replica scopes.

    Raises:
        The replica's own exception type (when it can be rebuilt with a message) naming the
        replica and device, chained to the original exception.
    """
    state = ThreadState.capture([d.type for d in devices])
    if len(devices) == 1:
        with _device_context(devices[0].device), _replica_scope(listeners, devices[0]):
            return [_run_named(fn, 0, devices[0], what)]
    # The caller queued each replica's input copies on its current stream of that device (as torch's
    # parallel_apply, hand that stream to the replica's thread): work queued after them there waits for them.
    streams = [get_device_type(d.type).current_stream(d.device) for d in devices]

    def task(i: int) -> T:
        device = devices[i]
        with state.entered(), _device_context(device.device), _stream_context(device.device, streams[i]):
            with _replica_scope(listeners, device):
                return fn(i)

    counts = _intra_op_threads(devices)
    # Where the replicas' intra-op threads are divided (CPU), every replica runs on a worker that keeps
    # its share from step to step, and the caller only waits: replica 0 on the caller would have to
    # change the caller's own count and back every step. Under torch.profiler replica 0 stays on the
    # caller, whose ops the trace records (it records the thread that started it).
    first = 1 if all(c is None for c in counts) or torch.autograd._profiler_enabled() else 0
    caller_threads = torch.get_num_threads()
    futures = [threads.submit(_bind(task, i, devices[i], what, counts[i]), slot=i) for i in range(first, len(devices))]
    results: list[Any] = [None] * len(devices)
    first_error: BaseException | None = None
    try:
        if first == 1:
            results[0] = _run_named(task, 0, devices[0], what)
    except BaseException as exc:  # still wait for the other replicas: no thread is left running
        first_error = exc
    for i, future in enumerate(futures, start=first):
        try:
            results[i] = future.result()
        except BaseException as exc:
            first_error = first_error or exc
    _restore_process_threads(caller_threads)
    if first_error is not None:
        raise first_error
    return results


def _bind(task: Callable[[int], T], i: int, device: ReplicaDevice, what: str, intra_op: int | None) -> Callable[[], T]:
    def run() -> T:
        if intra_op is not None:
            _use_intra_op_threads(device.type, intra_op)
        return _run_named(task, i, device, what)

    return run


def _intra_op_threads(devices: Sequence[ReplicaDevice]) -> list[int | None]:
    """Each replica's intra-op thread count, from its device type (None: leave the thread alone)."""
    per_type = {kind: sum(d.type == kind for d in devices) for kind in dict.fromkeys(d.type for d in devices)}
    counts = {kind: get_device_type(kind).replica_intra_op_threads(n) for kind, n in per_type.items()}
    return [counts[d.type] for d in devices]


# Intra-op thread counts. torch.set_num_threads(n) sets the OpenMP and MKL counts of the calling thread
# only, and also the process's figure that a thread takes on its first parallel op: a worker setting
# its share changes what new threads start with, until the outermost caller (no replica worker itself)
# puts its own count back after the step. A worker sets its count once, not every step: setting it also
# resizes torch's pthreadpool, which costs more than small models compute.
_local = threading.local()  # .intra_op: the count this thread set; .replica: it is a replica worker
_process_figure_changed = threading.Event()


def _use_intra_op_threads(kind: str, count: int) -> None:
    if getattr(_local, "intra_op", None) == count:
        return
    get_device_type(kind).enter_replica_thread(count)
    _local.intra_op = count
    _process_figure_changed.set()


def _restore_process_threads(caller_threads: int) -> None:
    """Put the outermost caller's count back as the process's figure, where a worker changed it."""
    if getattr(_local, "replica", False) or not _process_figure_changed.is_set():
        return
    _process_figure_changed.clear()
    torch.set_num_threads(caller_threads)
    _local.intra_op = caller_threads


def _run_named(task: Callable[[int], T], i: int, device: ReplicaDevice, what: str) -> T:
    try:
        return task(i)
    except Exception as exc:
        raise _named_error(exc, i, device, what) from exc


def _named_error(exc: Exception, i: int, device: ReplicaDevice, what: str) -> BaseException:
    """The replica's exception, rebuilt by torch's ExceptionWrapper with where it happened."""
    wrapper = ExceptionWrapper(
        (type(exc), exc, exc.__traceback__), where=f"in replica {i} on device {device.label} during {what}"
    )
    try:
        wrapper.reraise()
    except BaseException as named:
        return named
    raise AssertionError("ExceptionWrapper.reraise returned")  # pragma: no cover (reraise always raises)


def _replica_scope(listeners: Listeners | None, device: ReplicaDevice) -> Any:
    if listeners is None:  # the functional primitives: nobody to report to
        return contextlib.nullcontext()
    return listeners.replica_scope(device.label, device.device)


def _device_context(device: torch.device) -> Any:
    return get_device_type(device.type).device_context(device)


def _stream_context(device: torch.device, stream: Any) -> Any:
    return get_device_type(device.type).stream_context(stream)
