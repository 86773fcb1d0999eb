"""Bandwidth probes: copies and the DataParallel pattern, timed per message size.

Numbers follow the nccl-tests definitions: ``algbw = bytes / time``; ``busbw = algbw * factor``
with factor ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather and reduce-scatter, and 1 for
broadcast, reduce and point-to-point copies. One GB is 1e9 bytes. The all-reduce across processes
lives in :mod:`multigpu.launcher.allreduce_probe`.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from multigpu.core import comm
from multigpu.devices import ReplicaDevice, accelerator_type, common_type, device_count, get_device_type, synchronizer
from multigpu.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
DEFAULT_MIN_BYTES = KiB
DEFAULT_MAX_BYTES = 256 * MiB
MAX_MESSAGE_BYTES = 64 * GiB  # past any one device's memory today: a larger --max-size is a typo
_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": KiB,
    "m": MiB,
    "mib": MiB,
    "mb": MiB,
    "g": GiB,
    "gib": GiB,
    "gb": GiB,
}


def bus_factor(kind: str, ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor for a collective over ``ranks`` participants."""
    if kind == "all-reduce":
        return 2 * (ranks - 1) / ranks
    if kind in ("all-gather", "reduce-scatter"):
        return (ranks - 1) / ranks
    return 1.0


@dataclass
class BandwidthPoint:
    """One probe at one message size: seconds per operation and the derived bandwidths."""

    probe: str  # what moved, e.g. "copy cpu->cpu", "all-reduce gloo x2"
    kind: str  # "copy", "broadcast", "reduce", "all-reduce"
    nbytes: int  # message size per rank (nccl-tests' "size")
    seconds: float  # per operation (fastest of the timed loops)
    ranks: int = 1

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth, GB/s: message bytes over time."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def busbw(self) -> float:
        """Bus bandwidth, GB/s: algbw times the collective's factor (nccl-tests)."""
        return self.algbw * bus_factor(self.kind, self.ranks)


def parse_size(text: str) -> int:
    """Bytes from ``"256MiB"``, ``"64K"``, ``"1g"`` or ``"4096"`` (binary units).

    Example:
        >>> parse_size("1MiB")
        1048576
    """
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match[2].lower() not in _UNITS:
        raise ConfigError(
            f"size {text!r} does not parse; use a number of bytes with an optional unit, e.g. '64KiB' or '256MiB'"
        )
    return int(match[1]) * _UNITS[match[2].lower()]


def message_sizes(min_bytes: int = DEFAULT_MIN_BYTES, max_bytes: int = DEFAULT_MAX_BYTES, factor: int = 2) -> list[int]:
    """Sizes from ``min_bytes`` to ``max_bytes``, each ``factor`` times the last (nccl-tests' ``-f``)."""
    if min_bytes < 4 or min_bytes % 4:
        raise ConfigError(f"min size {min_bytes} bytes must be a positive multiple of 4 (float32 elements), e.g. 1KiB")
    if max_bytes > MAX_MESSAGE_BYTES:
        raise ConfigError(
            f"max size {max_bytes} bytes is above {MAX_MESSAGE_BYTES // GiB} GiB, more than a device holds; "
            "lower --max-size, e.g. 256MiB"
        )
    if max_bytes < min_bytes:
        raise ConfigError(f"max size {max_bytes} bytes is below the min size {min_bytes}; raise --max-size")
    if factor < 2:
        raise ConfigError(f"factor={factor} must be >= 2 (each size is factor times the previous)")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def iters_for(nbytes: int, *, window_bytes: int = 64 * MiB, max_iters: int = 2000) -> int:
    """Operations per timed loop: enough to move ``window_bytes`` (at least 1, at most ``max_iters``).

    A fixed count per size (as nccl-tests' ``-n``) rather than a time target: every rank of a
    collective runs the same number, and a hand-written loop of the same bytes measures the same
    window (benchmarks/bandwidth_check.py).
    """
    return max(1, min(max_iters, window_bytes // max(1, nbytes)))


def time_per_op(fn: Callable[[], object], sync: Callable[[], None], *, iters: int, repeats: int = 5) -> float:
    """Seconds per call of ``fn``: the fastest of ``repeats`` loops of ``iters`` back-to-back calls.

    The fastest loop, as STREAM reports its best rate: on a shared machine a loop that another
    process interrupts is slower by the interruption, never faster, so the minimum is the
    reproducible estimate of what the hardware gives (the median swings between modes).
    """
    if repeats < 1:
        raise ConfigError(f"repeats={repeats}: time at least one loop, e.g. repeats=5 (--repeats)")
    fn()
    sync()  # warm-up: first touch of the buffers, kernel selection
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()  # sync point: the loop's last operation must have finished
        samples.append((time.perf_counter() - start) / iters)
    return min(samples)


def copy_pairs() -> list[tuple[torch.device, torch.device]]:
    """The copies worth probing here: host->host, and host<->device, device->device on an accelerator."""
    cpu = torch.device("cpu")
    pairs = [(cpu, cpu)]
    accel = accelerator_type()
    if accel is not None:
        first = torch.device(accel, 0)
        pairs += [(cpu, first), (first, cpu), (first, first)]
        if device_count(accel) > 1:
            pairs.append((first, torch.device(accel, 1)))
    return pairs


def probe_copy(src_device: torch.device, dst_device: torch.device, nbytes: int, *, repeats: int = 5) -> BandwidthPoint:
    """Time ``dst.copy_(src)`` of ``nbytes`` (host buffers pinned when the other side's type pins them)."""
    pin = any(d.type != "cpu" and get_device_type(d.type).pin_memory for d in (src_device, dst_device))
    src = _buffer(nbytes, src_device, pin)
    dst = _buffer(nbytes, dst_device, pin)
    sync = synchronizer([src_device, dst_device])
    # a partial, not a lambda: no extra Python frame per copy (it shows at small sizes)
    copy = functools.partial(dst.copy_, src, non_blocking=True) if pin else functools.partial(dst.copy_, src)
    seconds = time_per_op(copy, sync, iters=iters_for(nbytes), repeats=repeats)
    return BandwidthPoint(
        probe=f"copy {_name(src_device)}->{_name(dst_device)}", kind="copy", nbytes=nbytes, seconds=seconds
    )


def probe_dp_pattern(
    devices: Sequence[ReplicaDevice], nbytes: int, *, repeats: int = 5
) -> tuple[list[BandwidthPoint], list[str]]:
    """The DataParallel engine's own broadcast (primary -> replicas) and reduce-add (replicas -> primary).

    Returns:
        The points, and notes on what was not probed (CPU replicas share the primary's
        parameters, so their broadcast moves no bytes).
    """
    torch_devices = [d.device for d in devices]
    primary, n = torch_devices[0], len(devices)
    sync = synchronizer(torch_devices)
    points, notes = [], []
    source = _buffer(nbytes, primary, False)
    fast = common_type(torch_devices)  # the engine's own fast path (CUDA's coalesced copies)
    if any(d != primary for d in torch_devices[1:]):
        broadcast = lambda: comm.broadcast_detached([source], torch_devices, fast)  # noqa: E731
        seconds = time_per_op(broadcast, sync, iters=iters_for(nbytes), repeats=repeats)
        points.append(
            BandwidthPoint(
                probe=f"broadcast {devices[0].label}->x{n}", kind="broadcast", nbytes=nbytes, seconds=seconds, ranks=n
            )
        )
    else:
        notes.append(f"broadcast to {n} replicas on {primary}: shared storage, no bytes move (not probed)")
    grads = [[_buffer(nbytes, d, False)] for d in torch_devices]
    seconds = time_per_op(lambda: comm.reduce_add(grads, primary, fast), sync, iters=iters_for(nbytes), repeats=repeats)
    points.append(
        BandwidthPoint(probe=f"reduce x{n}->{devices[0].label}", kind="reduce", nbytes=nbytes, seconds=seconds, ranks=n)
    )
    return points, notes


def _buffer(nbytes: int, device: torch.device, pin: bool) -> torch.Tensor:
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    return tensor.pin_memory() if pin and device.type == "cpu" else tensor


def _name(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else str(device)


def replica_devices_from_labels(labels: Sequence[str]) -> list[ReplicaDevice]:
    """Replica devices from report labels (``["cpu:0", "cpu:1"]`` or ``["cuda:0", "cuda:1"]``)."""
    return [
        ReplicaDevice(torch.device("cpu") if label.startswith("cpu") else torch.device(label), label)
        for label in labels
    ]


def probe_local(
    sizes: Sequence[int],
    devices: Sequence[ReplicaDevice],
    *,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[BandwidthPoint], list[str]]:
    """Every copy of :func:`copy_pairs` and the DataParallel pattern over ``devices``, at each size.

    Args:
        sizes: message sizes in bytes (see :func:`message_sizes`).
        devices: the replicas for the broadcast/reduce pattern, primary first.
        repeats: timed loops per point (the fastest is kept).
        progress: called with a short description after each point.

    Returns:
        The points and notes on what was not probed.
    """
    points: list[BandwidthPoint] = []
    notes: list[str] = []
    for size in sizes:
        for src, dst in copy_pairs():
            points.append(probe_copy(src, dst, size, repeats=repeats))
        if len(devices) > 1:
            found, why = probe_dp_pattern(devices, size, repeats=repeats)
            points += found
            notes += [n for n in why if n not in notes]
        if progress is not None:
            progress(f"local probes at {size} bytes")
    return points, notes
