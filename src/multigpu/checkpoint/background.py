"""Asynchronous saves (``Checkpointer(async_save=True)``): a snapshot in memory, the write on a thread.

:class:`Staging` copies a save's state into host buffers on the caller's thread (tensors that share
memory keep sharing it, so tied weights are written once as in a blocking save); the buffers are kept
and reused by the next save (pinned where the device wants it, e.g. CUDA). A storage's ``staged`` makes
its writer over such a snapshot, which runs the same protocol step as a blocking save, only on another
thread. A collective storage's (fsdp's) is written by every rank on its own thread, its collectives
(DCP's and the protocol's) on a gloo group of their own (:func:`side_group`,
:func:`~multigpu.checkpoint.ranks.on_group`), as ``torch.distributed.checkpoint.async_save`` asks for:
they never meet the training loop's collectives on the default group.

:class:`BackgroundWrite` owns that thread: at most one write in flight, started by :meth:`start` and
joined by :meth:`join`, which hands back what the write raised (once). The thread is not a daemon:
the interpreter waits for it before exiting (a run that leaves after a pre-emption stop keeps its
last checkpoint); a failure nobody collected is printed at exit, or when its Checkpointer is dropped.
A SIGKILL mid-write leaves only a temporary folder, as for a blocking save.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook registered before ours: see the end)
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from multigpu.checkpoint.ranks import on_group
from multigpu.devices import get_device_type
from multigpu.errors import CheckpointError
from multigpu.runtime.world import collective_timeout_s


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
