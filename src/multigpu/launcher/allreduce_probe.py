"""All-reduce bandwidth across processes: ``world_size`` local processes, one collective per size.

The launching half of the probe (the launcher's package: profiling, below it, does not start
processes). The processes are started as ``multigpu launch --strategy ddp`` starts a script
(:func:`multigpu.launcher.launch.launch`: torchrun, with its rendezvous store binding a port of
its own on 127.0.0.1, so no other process can take the port in between), each running
:mod:`multigpu.profiling._allreduce_worker`. It can run from the ``multigpu bandwidth`` command or
a test. Backend: nccl with one GPU per process when CUDA is visible, gloo on the CPU otherwise.
Each rank times ``all_reduce`` back to back; the reported time per size is the slowest rank's
(the collective finishes when its last rank does).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from multigpu.core.run_files import UnreadableFile, read_json
from multigpu.devices import backend_device_type, get_device_type, process_device_type
from multigpu.errors import ConfigError, DeviceError
from multigpu.launcher.config import LaunchConfig
from multigpu.launcher.launch import launch
from multigpu.profiling import _allreduce_worker
from multigpu.profiling.bandwidth import BandwidthPoint

_MAX_ITERS = 20  # per timed loop, as nccl-tests' default -n 20: small messages cost ~0.1-1 ms each on gloo
_WORKER = Path(_allreduce_worker.__file__)  # each rank runs it as its script


def default_backend() -> str:
    """The backend of the workers' device type where torch has it (nccl on CUDA), the CPU's (gloo) otherwise."""
    backend = process_device_type().backend
    return backend if dist.is_backend_available(backend) else get_device_type("cpu").backend


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
        timeout_s: a rank that waits longer than this in a collective fails, and no size is
            started after it has passed; either way the probe fails with ``TimeoutError``.
        repeats: timed loops per size; the fastest loop is kept.

    Returns:
        One point per size, ``kind="all-reduce"``, ``ranks=world_size``.

    Raises:
        ConfigError: fewer than 2 processes, or more than the backend's devices.
        TimeoutError: the probe ran past ``timeout_s``.
        RuntimeError: a worker failed (the launcher printed which rank, and its traceback).

    Example:
        >>> [p.busbw for p in probe_all_reduce([1 << 20], world_size=2)]  # doctest: +SKIP
    """
    backend = backend or default_backend()
    if world_size < 2:
        raise ConfigError(f"world_size={world_size}: an all-reduce needs at least 2 processes; use --world-size 2")
    kind = backend_device_type(backend)
    if kind is not None and world_size > kind.device_count():
        raise ConfigError(
            f"world_size={world_size} with {backend} needs one GPU per process, {kind.device_count()} "
            f"{kind.name} device(s) visible; lower --world-size"
        )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="multigpu-allreduce-") as tmp:
        out = Path(tmp)
        spec = {"sizes": list(sizes), "repeats": repeats, "backend": backend, "max_iters": _MAX_ITERS}
        (out / "probe.json").write_text(json.dumps({**spec, "deadline": time.time() + timeout_s}))
        code = _launch_workers(world_size, timeout_s, out)
        if code != 0:
            if time.monotonic() - started >= timeout_s:
                raise TimeoutError(
                    f"all-reduce probe did not finish in {timeout_s:.0f} s; raise the timeout or lower --max-size"
                )
            raise RuntimeError(
                f"all-reduce probe failed in a worker (exit code {code}); the launcher's summary above names the rank"
            )
        per_rank = [_seconds(out / f"rank{r}.json", len(sizes)) for r in range(world_size)]
    label = f"all-reduce {backend} x{world_size}"
    return [
        BandwidthPoint(
            probe=label, kind="all-reduce", nbytes=size, seconds=max(r[i] for r in per_rank), ranks=world_size
        )
        for i, size in enumerate(sizes)
    ]


def _seconds(path: Path, count: int) -> list[float]:
    """A rank's timings as its worker writes them: ``count`` finite seconds (RuntimeError naming the file else)."""
    try:
        data = read_json(path, limit=64 * count + 1024)
        if not isinstance(data, list) or len(data) != count:
            raise UnreadableFile(f"it holds {type(data).__name__} where the worker writes {count} timings")
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 for t in data):
            raise UnreadableFile("it holds something other than seconds")
    except UnreadableFile as exc:
        raise RuntimeError(f"all-reduce probe: {path}: {exc}; rerun the probe") from None
    return [float(t) for t in data]


def _launch_workers(world_size: int, timeout_s: float, out: Path) -> int:
    """Start the ranks the way ``multigpu launch --strategy ddp`` does; their exit code (0: all succeeded)."""
    config = LaunchConfig(
        strategy="ddp",
        nproc_per_node=world_size,
        collective_timeout_s=timeout_s,  # a rank stuck in a collective fails after this long
        grace_period_s=5.0,
        # Not bound to a core each (ddp's CPU default): the probe times the link, and a rank pinned to
        # one core of a busy machine waits for that core (measured 2-5x slower at 1-64 KiB on 2 cores).
        bind_cores=False,
    )
    try:
        return launch(config, str(_WORKER), [str(out)])
    except DeviceError as exc:  # e.g. gloo asked for more processes than this GPU node has GPUs
        raise ConfigError(f"world_size={world_size}: {exc}") from exc
