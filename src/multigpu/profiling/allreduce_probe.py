"""All-reduce bandwidth across processes: ``world_size`` local processes, one collective per size.

Starts the processes itself (spawn, rendezvous on 127.0.0.1 at a free port), so it can run from
the ``multigpu bandwidth`` command or a test. Backend: nccl with one GPU per process when CUDA
is visible, gloo on the CPU otherwise. Each rank times ``all_reduce`` back to back; the reported
time per size is the slowest rank's (the collective finishes when its last rank does).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from multigpu.errors import ConfigError
from multigpu.profiling.bandwidth import BandwidthPoint, iters_for, time_per_op

_MAX_ITERS = 20  # per timed loop, as nccl-tests' default -n 20: small messages cost ~0.1-1 ms each on gloo


def default_backend() -> str:
    """nccl where CUDA and NCCL are there, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def probe_all_reduce(
    sizes: Sequence[int],
    *,
    world_size: int = 2,
    backend: str | None = None,
    timeout_s: float = 300.0,
    repeats: int = 5,
) -> list[BandwidthPoint]:
    """Time ``all_reduce`` (sum, float32) of each size over ``world_size`` fresh local processes.

    Args:
        sizes: message sizes in bytes (per rank, as nccl-tests counts them).
        world_size: processes to start (with nccl: at most the number of GPUs).
        backend: ``"gloo"`` or ``"nccl"``; None picks :func:`default_backend`.
        timeout_s: the whole probe is stopped (processes killed) after this long.
        repeats: timed loops per size; the fastest loop is kept.

    Returns:
        One point per size, ``kind="all-reduce"``, ``ranks=world_size``.

    Example:
        >>> [p.busbw for p in probe_all_reduce([1 << 20], world_size=2)]  # doctest: +SKIP
    """
    backend = backend or default_backend()
    if world_size < 2:
        raise ConfigError(f"world_size={world_size}: an all-reduce needs at least 2 processes; use --world-size 2")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ConfigError(
            f"world_size={world_size} with nccl needs one GPU per process, {torch.cuda.device_count()} visible; lower --world-size"
        )
    with tempfile.TemporaryDirectory(prefix="multigpu-allreduce-") as tmp:
        out = Path(tmp)
        context = mp.start_processes(
            _worker,
            args=(world_size, backend, _free_port(), list(sizes), repeats, str(out)),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            deadline = time.monotonic() + timeout_s
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):  # False: some still run
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"all-reduce probe did not finish in {timeout_s:.0f} s; raise the timeout or lower --max-size"
                    )
        except mp.ProcessExitedException as exc:
            raise RuntimeError(f"all-reduce probe failed in a worker: {exc}") from exc
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    label = f"all-reduce {backend} x{world_size}"
    return [
        BandwidthPoint(
            probe=label, kind="all-reduce", nbytes=size, seconds=max(r[i] for r in per_rank), ranks=world_size
        )
        for i, size in enumerate(sizes)
    ]


def _worker(rank: int, world_size: int, backend: str, port: int, sizes: list[int], repeats: int, out: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        seconds = []
        for size in sizes:
            tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
            dist.barrier()
            # the count depends on the size only: every rank runs the same number of collectives
            iters = iters_for(size, max_iters=_MAX_ITERS)
            seconds.append(time_per_op(lambda: dist.all_reduce(tensor), sync, iters=iters, repeats=repeats))  # noqa: B023 (called at once, inside this iteration)
        Path(out, f"rank{rank}.json").write_text(json.dumps(seconds))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
