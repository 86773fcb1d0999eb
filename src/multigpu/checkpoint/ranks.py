"""Who writes a checkpoint, and when: the main process or every rank, now or on a thread in the background.

Inside a process group of several ranks rank 0 writes and the others wait (:func:`run_on_main`),
and a check every rank makes fails on every rank if it fails on one (:func:`agreed`), so no rank is
left waiting; outside one, nothing here communicates and the main process writes alone.

Each rank has its own random state (under a Session they differ per rank after ``setup_model``):
:func:`capture_rng` takes it as tensors, ints and tuples only, so ``state.pt`` loads with
``torch.load(weights_only=True)``; a save gathers every rank's on the main process and resume gives
each rank its own back. The accelerators' generators are read and set by their device objects
(:func:`multigpu.devices.capture_device_rng`), one entry per type name (``"cuda"``: a state per
CUDA device), so a checkpoint written before there were device objects restores unchanged.

An asynchronous save (``Checkpointer(async_save=True)``): :class:`Staging` copies its state into host
buffers on the caller's thread (tensors that share memory keep sharing it, so tied weights are written
once as in a blocking save); the buffers are kept and reused by the next save (pinned where the device
wants it, e.g. CUDA). A storage's ``staged`` makes its writer over such a snapshot, which runs the same
protocol step as a blocking save, only on another thread. A collective storage's (fsdp's) is written by
every rank on its own thread, its collectives (DCP's and the protocol's) on a gloo group of their own
(:func:`side_group`, :func:`on_group`), as ``torch.distributed.checkpoint.async_save`` asks for: they
never meet the training loop's collectives on the default group. :class:`BackgroundWrite` owns that
thread: at most one write in flight, started by :meth:`~BackgroundWrite.start` and joined by
:meth:`~BackgroundWrite.join`, which hands back what the write raised (once). The thread is not a
daemon: the interpreter waits for it before exiting (a run that leaves after a pre-emption stop keeps
its last checkpoint); a failure nobody collected is printed at exit, or when its Checkpointer is
dropped. A SIGKILL mid-write leaves only a temporary folder, as for a blocking save.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook registered before ours: see the end)
import contextlib
import random
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from multigpu.devices import capture_device_rng, device_type_names, get_device_type, restore_device_rng
from multigpu.errors import CheckpointError
from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.collectives import issuing
from multigpu.runtime.world import collective_timeout_s, in_process_group, is_main_process, world_size

T = TypeVar("T")
_thread = threading.local()  # .group: the process group of this thread's checkpoint collectives


@contextlib.contextmanager
def on_group(group: Any) -> Iterator[None]:
    """This thread's checkpoint collectives (here and DCP's) go over ``group`` instead of the default group.

    For a write in the background (:class:`BackgroundWrite`): its collectives must not interleave with the
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


# --- asynchronous saves: a snapshot in memory, the write on a thread ---


class Staging:
    """Host copies of a state, in buffers reused from one :meth:`copy` to the next."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self.kept: dict[str, Any] = {}  # a storage's own stager, kept between saves too (the sharded one's: DCP's)

    def copy(self, state: Any) -> Any:
        """``state`` with every tensor copied into a staging buffer; containers are rebuilt, other values kept.

        Tensors that share a storage share one buffer (viewed as they were). Only strided tensors
        are staged through buffers; others are cloned to the CPU.
        """
        staged: dict[tuple[int, torch.device], torch.Tensor] = {}
        used = 0

        def buffer_for(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal used
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), tensor.device)
            found = staged.get(key)
            if found is not None:
                return found
            pin = tensor.device.type != "cpu" and get_device_type(tensor.device).pin_memory
            if used < len(self._buffers) and self._buffers[used].numel() == storage.nbytes():
                buf = self._buffers[used]
            else:
                buf = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                if used < len(self._buffers):
                    self._buffers[used] = buf
                else:
                    self._buffers.append(buf)
            used += 1
            source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            buf.copy_(source)
            staged[key] = buf
            return buf

        def walk(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if (
                    value.layout != torch.strided
                    or value.is_quantized
                    or value.is_conj()
                    or value.is_neg()
                    or value.device.type == "meta"
                ):
                    return value.detach().to("cpu", copy=True)
                buf = buffer_for(value)
                view = torch.empty(0, dtype=value.dtype)
                return view.set_(buf.untyped_storage(), value.storage_offset(), value.size(), value.stride())
            if isinstance(value, Mapping):
                items = [(k, walk(v)) for k, v in value.items()]
                return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
            if isinstance(value, list):
                return [walk(v) for v in value]
            if isinstance(value, tuple):
                items = [walk(v) for v in value]
                return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
            return value

        result = walk(state)
        del self._buffers[used:]  # what this state no longer needs
        return result


_side: tuple[Any, Any] | None = None  # (the default group, the background writes' group)


def side_group() -> Any:
    """The gloo group of every rank that this process's collective background writes use, one per default group.

    Creating it is a collective: every rank calls this at the same save (the first asynchronous one of
    a collective storage, or the first after the default group was made again). It copies the default group's
    timeout (``--collective-timeout``, ``Session(timeout_s=...)``). One for all Checkpointers, so
    that a Checkpointer made for each save does not leave a group behind each time: their writes
    take turns (:meth:`BackgroundWrite.start`).
    """
    global _side
    world = dist.group.WORLD
    if _side is None or _side[0] is not world:
        try:  # torch keeps a gloo group's timeout in its options (2.13)
            timeout = world._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
        except Exception:  # no CPU backend (nccl alone) or another torch: the launch's
            timeout = timedelta(seconds=collective_timeout_s())
        _side = (world, dist.new_group(backend="gloo", timeout=timeout))
    return _side[1]


class BackgroundWrite:
    """One write at a time on a thread of its own; what it raised is kept for :meth:`join`."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._what = ""
        self._group: Any = None
        _live.add(self)

    def start(self, write: Callable[[], Any], what: str, *, group: Any = None) -> None:
        """Run ``write`` on a new thread (its checkpoint collectives over ``group``); join the previous first."""
        if self._thread is not None:
            raise RuntimeError("a background checkpoint write is still pending: join it first")
        if group is not None:  # one write at a time on a group: another Checkpointer's goes first
            for other in list(_live):  # (every rank saves in the same order, so they wait for the same)
                if other._group is group:
                    other.finish()  # its failure stays for its own wait()
        self._what, self._failure, self._group = what, None, group

        def run() -> None:
            try:
                with on_group(group):
                    write()
            except BaseException as exc:  # kept for the caller's thread, which raises it
                self._failure = exc

        self._thread = threading.Thread(target=run, name=f"multigpu-checkpoint-{what}", daemon=False)
        self._thread.start()

    def finish(self) -> None:
        """Wait for the write in flight; what it raised is kept for :meth:`join`."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def join(self) -> CheckpointError | None:
        """Wait for the write in flight; what it raised as a :class:`CheckpointError` (once), or ``None``."""
        self.finish()
        failure, self._failure = self._failure, None
        if failure is None or isinstance(failure, CheckpointError):
            return failure
        error = CheckpointError(
            f"writing checkpoint {self._what} in the background failed ({type(failure).__name__}: "
            f"{str(failure)[:300]}); the previous checkpoint is unchanged and still the latest."
        )
        error.__cause__ = failure
        return error

    def __del__(self) -> None:  # a Checkpointer dropped with a failure nobody collected: said, as at exit
        if self._failure is not None:
            print(f"multigpu: {self.join()}", file=sys.stderr, flush=True)


_live: weakref.WeakSet[BackgroundWrite] = weakref.WeakSet()


def finish_pending_writes() -> None:
    """Wait for every checkpoint write still in flight in this process and print a failure nobody collected
    with ``wait()``/``close()``: what the process's end does (the interpreter joins the write threads, then
    runs this). ``launch_function``'s ranks call it before they report, since the caller stops them then."""
    for writer in list(_live):
        failure = writer.join()
        if failure is not None:
            print(f"multigpu: {failure}", file=sys.stderr, flush=True)


# At the process's end the write must finish before threading's shutdown has gone on: concurrent.futures
# refuses new work from the moment it starts ("cannot schedule new futures after interpreter shutdown"), and
# the write checksums in thread pools (formats.py, manifest.py), so a write still pending then failed. threading's own
# exit hooks run last-registered first, so registered after concurrent.futures' (imported above) this one
# runs first, while pools still take work. atexit's is the fallback where threading has no such hook.
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(finish_pending_writes)
else:  # pragma: no cover
    atexit.register(finish_pending_writes)
