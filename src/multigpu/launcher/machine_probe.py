"""Measure this machine's constants for a CPU plan (:class:`multigpu.planning.machine.MachineConstants`).

In this process: the host costs, memory bandwidth and DataParallel's hand-off per replica and phase
(:mod:`multigpu.planning.calibrate`, :func:`multigpu.planning.step_floors.dp_handoff_s`). Then two
pairs of gloo processes, one after the other, each :mod:`multigpu.planning._machine_probe_worker`
with one intra-op thread per process, bound to its share of the cores as the launcher binds its
workers: one pair with ddp's environment times the all-reduce and DDP's own cost per step, one
with fsdp's (on a CPU, its malloc settings: every large buffer mapped anew) times the all-gather, the reduce-scatter, a copy into fresh memory, a large allocation (a
fresh buffer filled against a warm one, at three sizes: per allocation, per byte on 4 KiB pages and on huge ones) and FSDP2's work
per group (a step of tiny groups sharded over the two, less the same step unsharded: by the
thread's CPU time, and by the wall time less the latency of its collectives, which the plan charges
apart; the larger). Each collective is timed at two sizes, in sequences of several calls as a
step issues them: the small one gives the latency per call, the difference the bus bandwidth
(nccl-tests' definition). The slower rank's figure is kept.
A few seconds in all; :func:`multigpu.planning.machine.save` caches the result.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from multigpu.errors import LaunchError
from multigpu.launcher.affinity import core_share
from multigpu.planning import _machine_probe_worker as worker
from multigpu.planning.costs import SMALL_PAGE_BYTES
from multigpu.planning.machine import MachineConstants, machine_key
from multigpu.profiling.bandwidth import bus_factor
from multigpu.runtime.worker_env import WorkerEnv

_WORKER = Path(worker.__file__)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bind(pid: int, rank: int) -> None:
    """Bind probe process ``rank`` of 2 to its share of the cores, as ``multigpu launch`` binds ddp's and fsdp's
    workers on a CPU (:mod:`multigpu.launcher.affinity`): unbound, the two processes and their gloo threads
    meet on every core, and their collectives take longer than the launched runs' do. Set right after the
    start, before the worker has a thread of its own (the threads it starts inherit it)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    share = core_share(os.sched_getaffinity(0), rank, 2)
    if share is not None:
        with contextlib.suppress(OSError):  # gone already: its own error is reported
            os.sched_setaffinity(pid, share)


def _pair(kind: str, extra_env: dict[str, str], timeout_s: float) -> dict[str, float]:
    """Both ranks' figures of ``kind``, the slower of the two for each; none of the processes outlives it."""
    env = {**os.environ, **extra_env, **WorkerEnv(threads=1).to_environ()}
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="multigpu-probe-") as folder:
        outs = [Path(folder, f"rank{r}.json") for r in range(2)]
        procs = [
            subprocess.Popen(
                [sys.executable, str(_WORKER), str(r), str(port), kind, str(outs[r])],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        for rank, proc in enumerate(procs):
            _bind(proc.pid, rank)
        errors = []
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=timeout_s)
                if proc.returncode != 0:
                    errors.append((err or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"])
        except subprocess.TimeoutExpired as exc:
            raise LaunchError(
                f"the planner's {kind} probe did not finish within {timeout_s:.0f} s; rerun with --recalibrate "
                "when the machine is less loaded"
            ) from exc
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)
        if errors:
            raise LaunchError(f"the planner's {kind} probe failed: {errors[0][0]}")
        ranks = [json.loads(out.read_text()) for out in outs]
    return {name: max(r[name] for r in ranks) for name in ranks[0]}


def _latency_and_busbw(kind: str, small_s: float, large_s: float) -> tuple[float, float]:
    """(seconds per call, bus bandwidth) of a collective timed at the worker's two sizes."""
    factor = bus_factor(kind, 2)
    wire = max(large_s - small_s, 1e-9)
    busbw = (worker.LARGE - worker.SMALL) * factor / wire
    return max(0.0, small_s - worker.SMALL * factor / busbw), busbw


def _fresh_costs(figures: dict[str, float]) -> tuple[float, float, float]:
    """(seconds per allocation, per byte on 4 KiB pages, per byte on huge pages) a fresh buffer costs beyond a
    warm one: the two sizes under 2 MiB give the first two, the large one the third for its bytes past the
    first :data:`~multigpu.planning.costs.SMALL_PAGE_BYTES` (a mapping at a 4 KiB boundary holds no huge page
    until the first 2 MiB boundary, and none after the last: about 2 MiB of small pages in all)."""
    fresh = {
        label: max(0.0, figures[f"fresh_fill_{label}_s"] - figures[f"warm_fill_{label}_s"])
        for label in ("small", "mid", "large")
    }
    per_byte = max(0.0, fresh["mid"] - fresh["small"]) / (worker.FRESH_MID - worker.FRESH_SMALL)
    per_alloc = max(0.0, fresh["small"] - worker.FRESH_SMALL * per_byte)
    on_huge = max(0.0, fresh["large"] - per_alloc - SMALL_PAGE_BYTES * per_byte) / (
        worker.FRESH_LARGE - SMALL_PAGE_BYTES
    )
    return per_alloc, per_byte, min(on_huge, per_byte)


def _fsdp_group_s(figures: dict[str, float], latency_s: float) -> float:
    """FSDP2's seconds per group and step: the sharded step of the worker's tiny blocks over the unsharded
    one, over its groups (the root's too). By the thread's CPU time, FSDP2's own work; by the wall
    time, less the latency of the step's collectives (which the plan charges apart,
    :func:`multigpu.planning.costs.fsdp_collectives`), also the waits of two processes meeting at each
    collective while both compute, which an idle collective's latency does not hold: the larger."""
    own = figures["fsdp_step_sharded_s"] - figures["fsdp_step_plain_s"]
    collectives = 3 * worker.FSDP_GROUPS  # each block gathered twice and reduce-scattered once; the root is empty
    waits = figures["fsdp_step_sharded_wall_s"] - figures["fsdp_step_plain_wall_s"] - collectives * latency_s
    return max(0.0, own, waits) / (worker.FSDP_GROUPS + 1)


def probe_machine(*, timeout_s: float = 120.0) -> MachineConstants:
    """This machine's constants, measured now (a few seconds)."""
    from multigpu.devices import get_device_type
    from multigpu.planning.calibrate import measure_host_costs, memory_bandwidth
    from multigpu.planning.step_floors import dp_handoff_s
    from multigpu.strategies import get_strategy

    host = measure_host_costs(replicate="multigpu", fsdp_groups=0)
    plain = _pair("allreduce", {}, timeout_s)
    sharded_env = get_strategy("fsdp").launch_env(get_device_type("cpu"), dict(os.environ))
    sharded = _pair("sharded", sharded_env, timeout_s)
    allreduce = _latency_and_busbw("all-reduce", plain["allreduce_small_s"], plain["allreduce_large_s"])
    gather = _latency_and_busbw(
        "all-gather",
        (sharded["gather_small_s"] + sharded["scatter_small_s"]) / 2,
        (sharded["gather_large_s"] + sharded["scatter_large_s"]) / 2,
    )
    fresh_alloc_s, fresh_byte_s, fresh_huge_byte_s = _fresh_costs(sharded)
    return MachineConstants(
        key=machine_key(),
        host=replace(host, fsdp_group_s=_fsdp_group_s(sharded, gather[0])),
        memory_bandwidth=memory_bandwidth(),
        thread_overhead_s=dp_handoff_s(),
        allreduce_latency_s=allreduce[0],
        allreduce_busbw=allreduce[1],
        gather_latency_s=gather[0],
        gather_busbw=gather[1],
        fresh_copy_bandwidth=2 * worker.LARGE / sharded["fresh_copy_s"],
        fresh_alloc_s=fresh_alloc_s,
        fresh_byte_s=fresh_byte_s,
        fresh_huge_byte_s=fresh_huge_byte_s,
        ddp_step_s=plain["ddp_step_s"],
        source="measured here by multigpu advise (two gloo processes of one thread each)",
    )
