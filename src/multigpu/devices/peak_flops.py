"""The FLOP/s one device reaches at most: the denominator of model FLOPs utilisation (MFU).

Two sources, in order:

1. A datasheet figure, for the data-centre GPUs MFU is usually quoted on (dense, without sparsity;
   :data:`DATASHEET`, matched on the device's name). This is the convention of published MFU figures.
2. Measured: the fastest of a few square matmuls in the dtype (:func:`measure_matmul_flops`), for every
   other device, the CPU included. A CPU has no datasheet figure that means anything under load, so its
   "peak" is what its matmul reaches here with this process's intra-op threads (an MFU near 1 on a CPU
   says the step runs at matmul speed, not at the silicon's limit).

A measured figure is cached per machine, device, dtype and thread count in a small JSON file (the
caller names it; ``multigpu.runtime.world.cache_dir()`` by default), so a run pays for the measurement
(about a second on a CPU) once per machine. The file is read as untrusted (bounded, finite numbers);
a garbled one is measured over.

Example:
    >>> from multigpu.devices import get_device_type
    >>> get_device_type("cpu").peak_flops(torch.device("cpu"), torch.float32) > 1e8   # doctest: +SKIP
    True
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path
from typing import Protocol

import torch

from multigpu.core.folder_turns import taking_turns
from multigpu.core.limits import to_float
from multigpu.core.run_files import UnreadableFile, read_json, remove_partials, write_replacing


class DeviceType(Protocol):
    """What this module asks of :class:`multigpu.devices.base.DeviceType` (which imports it)."""

    def synchronize(self, device: torch.device) -> None: ...

    def device_name(self, device: torch.device) -> str: ...


# Dense peak FLOP/s by name fragment (checked in order: the first fragment in the device's name wins),
# from NVIDIA's datasheets: H100 (SXM5, PCIe, NVL), H200, A100 (SXM4 and PCIe alike), V100 (SXM2).
# fp32 matmuls are taken at the fp32 peak: torch keeps TF32 off for matmuls by default.
DATASHEET: tuple[tuple[str, dict[torch.dtype, float]], ...] = (
    ("H100 PCIe", {torch.float32: 51e12, torch.bfloat16: 756e12, torch.float16: 756e12}),
    ("H100 NVL", {torch.float32: 60e12, torch.bfloat16: 835e12, torch.float16: 835e12}),
    ("H100", {torch.float32: 67e12, torch.bfloat16: 989e12, torch.float16: 989e12}),
    ("H200", {torch.float32: 67e12, torch.bfloat16: 989e12, torch.float16: 989e12}),
    ("A100", {torch.float32: 19.5e12, torch.bfloat16: 312e12, torch.float16: 312e12}),
    ("V100", {torch.float32: 15.7e12, torch.float16: 125e12}),
)
_CACHE_BYTES = 1 << 16  # a cache file larger than this is not ours
_SIZE = 1024  # matmul side: 2 GFLOP a product, ~20 ms on two CPU cores, microseconds on a GPU
_REPEATS = 5
_TURN_S = 30.0  # seconds another writer may hold the cache folder (it holds it for milliseconds)


def datasheet_flops(name: str, dtype: torch.dtype) -> float | None:
    """The datasheet's dense peak for a device called ``name`` in ``dtype``; None when not listed.

    Example:
        >>> datasheet_flops("NVIDIA H100 80GB HBM3", torch.bfloat16)
        989000000000000.0
        >>> datasheet_flops("cpu", torch.float32) is None
        True
    """
    for fragment, peaks in DATASHEET:
        if fragment in name:
            return peaks.get(dtype)
    return None


def measure_matmul_flops(kind: DeviceType, device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the fastest of a few ``_SIZE``-square matmuls in ``dtype`` on ``device`` (after one warm-up)."""
    a = torch.randn(_SIZE, _SIZE, device=device).to(dtype)
    b = torch.randn(_SIZE, _SIZE, device=device).to(dtype)
    torch.mm(a, b)
    fastest = float("inf")
    for _ in range(_REPEATS):
        kind.synchronize(device)  # a sync point: the clock must not start before queued work ends
        began = time.perf_counter()
        torch.mm(a, b)
        kind.synchronize(device)
        fastest = min(fastest, time.perf_counter() - began)
    return 2 * _SIZE**3 / max(fastest, 1e-9)


def peak_flops(kind: DeviceType, device: torch.device, dtype: torch.dtype, cache: Path | None) -> float:
    """``device``'s peak in ``dtype``: the datasheet's, else measured once per machine (cached in ``cache``)."""
    name = kind.device_name(device)
    listed = datasheet_flops(name, dtype)
    if listed is not None:
        return listed
    key = f"{platform.node()}|{device.type}:{name}|{dtype}|threads={torch.get_num_threads()}"
    known = _read(cache)
    if isinstance(known.get(key), float) and known[key] > 0:
        return float(known[key])
    measured = measure_matmul_flops(kind, device, dtype)
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            # one writer at a time, each adding its key to the file as the last left it (another process or thread
            # may have measured another dtype meanwhile): TimeoutError, an OSError, after a stopped writer's 30 s
            with taking_turns(cache.parent, hold_s=_TURN_S, held_too_long=TimeoutError) as held:
                if held:  # no writer is inside its turn: a partial here is one a killed writer left
                    remove_partials(cache)
                write_replacing(cache, json.dumps({**_read(cache), key: measured}, indent=1))
        except OSError:
            pass  # a read-only home: measured again next run, nothing else lost
    return measured


def _read(cache: Path | None) -> dict[str, float]:
    if cache is None or not cache.exists():
        return {}
    try:
        data = read_json(cache, limit=_CACHE_BYTES)
    except UnreadableFile:
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        k: float(v)
        for k, v in data.items()
        if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(to_float(v))
    }
