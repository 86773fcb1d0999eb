"""The CPU as a device type: always there, one device (any number of replicas on it), no queue to wait for.

Nothing runs asynchronously on the CPU, so synchronizing is a no-op and the host clock times it.
Its memory has no allocator statistics: per-replica memory comes from the allocation tracker
(:mod:`multigpu.profiling.memory`). A process sharding its model (fsdp) starts with glibc's malloc
set to return large freed buffers to the system (:meth:`CpuDevice.sharded_process_env`). Its
random state is torch's default generator, which callers read with ``torch.get_rng_state()``; it
has no per-device generators of its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from multigpu.devices.base import DeviceType, Mark


class CpuDevice(DeviceType):
    """The CPU (see the module docstring)."""

    name = "cpu"
    display = "CPU"
    backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def default_replicas(self) -> int:
        """Two: replicas (or processes) on the CPU share its cores, so more buy no speed, but two exercise
        every multi-device path (split, gather, gradient sum, all-reduce)."""
        return _DEFAULT_CPU_REPLICAS

    def replicas_spec(self, count: int) -> str:
        return f"cpu:{count}"  # replicas share the one CPU

    def synchronize(self, device: torch.device | None = None) -> None:
        return None  # CPU ops have finished when they return

    def mark(self, device: torch.device) -> Mark:
        return time.perf_counter()

    def device_context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def set_device(self, device: torch.device) -> None:
        return None

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def current_stream(self, device: torch.device) -> Any:
        return None

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def replica_intra_op_threads(self, replicas: int) -> int | None:
        """The caller's intra-op threads divided among the replicas (at least one each).

        CPU replicas compute on the same cores as the caller: two replica threads that each opened
        an OpenMP team of the caller's size would run 2x as many threads as cores. The count is
        per thread (``torch.set_num_threads`` sets the OpenMP and MKL counts of the thread calling
        it), so each replica thread can be given its share (:mod:`multigpu.parallel.threads`).
        """
        return max(1, torch.get_num_threads() // max(1, replicas))

    def enter_replica_thread(self, intra_op: int) -> None:
        """Set the replica thread's count; the first time, park one OpenMP team thread in it.

        Why: after a parallel region libgomp's idle team threads spin (GOMP_SPINCOUNT, 300,000
        pauses: 4-8 ms of a core here) before they sleep, unless the process has more OpenMP
        threads than cores, when they spin 100 pauses. While the replicas compute, the caller
        waits, and its own team's thread would spin on a core a replica needs, after every
        parallel op the caller ran (the loss, the gradient of the gathered outputs, the optimizer).
        Leading one 2-thread team from each replica thread keeps one more idle OpenMP thread in
        the process for as long as the replica thread lives (the model's workers), which puts
        libgomp in its short spin; when they end, the default returns. The environment variables
        that set the spin (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) are read once, when torch loads.
        """
        # The thread's first parallel op would reset its count from the process's figure: take that now.
        # A process of one intra-op thread has no team threads to spin: nothing to park then.
        if torch.get_num_threads() > 1 and not getattr(_replica_thread, "team_parked", False):
            torch.set_num_threads(2)
            torch.ones(_TWO_CHUNKS).add_(1)  # one parallel op of 2 threads: its helper stays parked
            _replica_thread.team_parked = True
        torch.set_num_threads(intra_op)

    def sharded_process_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """glibc's malloc with a fixed mmap threshold, on huge pages, unless the user configured malloc.

        By default glibc raises its mmap threshold when the first large buffer is freed, and then
        serves buffers of that size from its heap, which fragments and keeps them resident: fsdp's
        peak per process on CPU was 1.76x ddp's. With the threshold fixed at 128 KiB each large
        buffer is mapped when allocated and unmapped when freed: 0.51x, for steps about 1.3x as
        long; huge pages make the mapping cheaper (``benchmarks/fsdp_memory.py``). Other C
        libraries ignore the variable.
        """
        tunables = environ.get("GLIBC_TUNABLES", "")
        if "glibc.malloc." in tunables or any(name.startswith("MALLOC_") for name in environ):
            return {}  # the user's own malloc settings
        return {"GLIBC_TUNABLES": ":".join(filter(None, [tunables, *_RETURN_FREED_BUFFERS]))}

    def get_rng_state_all(self) -> list[torch.Tensor] | None:
        return None  # torch.get_rng_state() is the CPU's state; callers keep it under its own name

    def set_rng_state_all(self, states: Any) -> None:
        return None

    def device_name(self, device: torch.device) -> str:
        return "cpu"

    def describe(self, index: int) -> str:
        return "cpu"


_DEFAULT_CPU_REPLICAS = 2
_replica_thread = threading.local()
_TWO_CHUNKS = 2 * 32768  # at::internal::GRAIN_SIZE: an elementwise op of this size splits in two

# Buffers of at least this many bytes are mapped anew in a sharded process (the planner counts a
# step's allocations from here up: multigpu.planning.allocations).
SHARDED_MMAP_THRESHOLD = 128 << 10
# glibc tunables (glibc >= 2.35 for hugetlb; an older glibc ignores what it does not know).
_RETURN_FREED_BUFFERS = (f"glibc.malloc.mmap_threshold={SHARDED_MMAP_THRESHOLD}", "glibc.malloc.hugetlb=1")
