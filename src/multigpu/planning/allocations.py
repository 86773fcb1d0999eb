"""The CPU allocations one training step makes at or above a size: what fsdp's processes map anew each step.

fsdp's processes on a CPU run glibc's malloc with a fixed mmap threshold
(:meth:`multigpu.devices.cpu.CpuDevice.sharded_process_env`): every buffer at or above it is
mapped when allocated and unmapped when freed, so each step pays a page fault per page it touches
again, in activations and their gradients as much as in gathered parameters. A convolutional
model allocates many large buffers per step, most of them inside its kernels (the columns of a
convolution's unfolded input, its backward's workspaces) where no ``TorchDispatchMode`` sees them;
torch's CPU allocator reports each one to the profiler (``profile_memory=True``), and that is what
:func:`large_allocations` counts, over one call.

Example:
    >>> import torch
    >>> seen = large_allocations(lambda: (torch.ones(1 << 16), torch.ones(8)), threshold=1 << 17)
    >>> (seen.count, seen.bytes)
    (1, 262144)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# What torch's profiler writes to stderr at each start and stop (this build's kineto), and its note
# on blocks freed during the call that were allocated before it: chatter around the count, not news.
_PROFILER_CHATTER = ("profiler_start", "profiler_stop", "allocated before the profiling started")


@dataclass(frozen=True)
class Allocations:
    """``count`` allocations of ``bytes`` in all (each at or above the threshold it was counted at)."""

    count: int
    bytes: int


@contextmanager
def _profiler_chatter_dropped() -> Iterator[None]:
    """Run the block with file descriptor 2 in a temporary file, then write back every line but the chatter."""
    with tempfile.TemporaryFile(mode="w+b") as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if not _is_chatter(line)]
            if kept:
                os.write(2, b"".join(kept))


def _is_chatter(line: bytes) -> bool:
    text = line.decode(errors="replace")
    return any(marker in text for marker in _PROFILER_CHATTER)


def large_allocations(fn: Callable[[], object], *, threshold: int) -> Allocations:
    """The CPU allocations of ``threshold`` bytes or more that one call of ``fn`` makes (torch's own record).

    Args:
        fn: one call to watch (a training step: zero_grad, forward, loss, backward).
        threshold: the smallest allocation counted, in bytes (fsdp's processes: their mmap threshold).

    Returns:
        How many such allocations the call made and their bytes, each counted once however long it lives.
    """
    from torch.profiler import ProfilerActivity, profile

    with _profiler_chatter_dropped(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    large = [n for n in sizes if n >= threshold]
    return Allocations(len(large), sum(large))


__all__ = ["Allocations", "large_allocations"]
