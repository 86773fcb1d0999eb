"""Small measurements for the GPU check (scripts/gpu_check.py runs them; each prints one JSON object).

    python scripts/gpu_probes.py dp-overhead --device cuda:0   # DataParallel on one GPU vs the bare module
    python scripts/gpu_probes.py copies --device cuda:0        # device->device and host->device, pinned or not

Both run on the CPU too (``--device cpu``), which is how the test suite checks them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from torch import nn

import multigpu
from multigpu.devices import get_device_type, synchronizer
from multigpu.profiling.bandwidth import time_per_op


def _fastest_ms(fn: Callable[[], object], device: torch.device, *, iters: int) -> float:
    """Milliseconds per call: the profiler's timer, which waits for ``device``'s queue (a sync point) around each loop."""
    return time_per_op(fn, synchronizer([device]), iters=iters) * 1e3


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10)).to(device)


def dp_overhead(device: torch.device, batch: int, iters: int) -> dict[str, object]:
    """One training step of the bare module against ``multigpu.DataParallel`` on the same one device."""
    bare = _model(device)
    wrapped = multigpu.DataParallel(_model(device), devices=[str(device)] if device.type != "cpu" else "cpu")
    x = torch.randn(batch, 1024, device=device)

    def step(model: nn.Module) -> Callable[[], object]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()

        return run

    bare_ms = _fastest_ms(step(bare), device, iters=iters)
    dp_ms = _fastest_ms(step(wrapped), device, iters=iters)
    # nn.DataParallel with one device moves the inputs there: a CPU batch into a CUDA model works.
    host_batch = torch.randn(8, 1024)
    expected = bare(host_batch.to(device))
    got = wrapped(host_batch)
    return {
        "probe": "dp-overhead",
        "device": str(device),
        "batch": batch,
        "bare_ms": round(bare_ms, 4),
        "dataparallel_ms": round(dp_ms, 4),
        "ratio": round(dp_ms / bare_ms, 4),
        "cpu_batch_into_model": bool(got.device == expected.device and torch.allclose(got, expected)),
    }


def copies(device: torch.device, nbytes: int, iters: int) -> dict[str, object]:
    """GB/s (1e9 bytes) of a copy within the device, and from the host pinned and pageable."""
    numel = nbytes // 4
    src = torch.empty(numel, device=device)
    dst = torch.empty(numel, device=device)
    pageable = torch.empty(numel)
    pin = get_device_type(device).pin_memory  # pinned host buffers only where the device type copies from them faster
    pinned = pageable.pin_memory() if pin else pageable

    def gbps(fn: Callable[[], object]) -> float:
        return round(nbytes / (_fastest_ms(fn, device, iters=iters) / 1e3) / 1e9, 2)

    return {
        "probe": "copies",
        "device": str(device),
        "bytes": nbytes,
        "device_to_device_GBps": gbps(lambda: dst.copy_(src)),
        "host_pageable_to_device_GBps": gbps(lambda: dst.copy_(pageable, non_blocking=False)),
        "host_pinned_to_device_GBps": gbps(lambda: dst.copy_(pinned, non_blocking=pin)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["dp-overhead", "copies"])
    parser.add_argument("--device", default="cuda:0", help="where to measure (default cuda:0; 'cpu' works too)")
    parser.add_argument("--batch", type=int, default=256, help="dp-overhead: samples per step")
    parser.add_argument("--bytes", type=int, default=256 * 2**20, help="copies: message size")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per repeat (the fastest repeat counts)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.probe == "dp-overhead":
        result = dp_overhead(device, args.batch, args.iters)
    else:
        result = copies(device, args.bytes, args.iters)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
