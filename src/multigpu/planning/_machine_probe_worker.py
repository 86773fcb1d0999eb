"""One of the two processes that measure gloo's collectives for the planner (:mod:`multigpu.launcher.machine_probe`).

``python _machine_probe_worker.py RANK PORT KIND OUT``: joins a 2-process gloo group on 127.0.0.1,
one intra-op thread (as each of ddp's and fsdp's processes on a 2-core CPU), and writes ``OUT``
(JSON) with seconds per call, each the low quantile of :mod:`multigpu.planning.timing` (a collective's: of
sequences of :data:`SEQUENCE` calls, per call):

- ``allreduce``: ``all_reduce`` of a small and a large array (what ddp's buckets do), and what DDP adds
  to a step beyond its all-reduce (:func:`multigpu.planning.step_floors.ddp_step_s`);
- ``sharded`` (started with fsdp's malloc settings): an all-gather and a reduce-scatter into
  fresh buffers, small and large (as FSDP2 allocates them every step), a copy into a fresh buffer,
  a fresh buffer filled against a warm one of the same size at three sizes above the mmap threshold
  (what each large allocation of a step costs there: the mapping, a page fault per 4 KiB page, and
  less per byte on the huge pages a buffer past 2 MiB gets), and
  FSDP2's work per group inside the group (``fsdp_step_*``: a training step of :data:`FSDP_GROUPS`
  tiny Linear blocks, each its own group sharded over both processes, and of the same stack
  unsharded; the calling thread's CPU time: FSDP2's own work; and the wall times of the two in
  alternation: the waits at each collective too).
"""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from multigpu.strategies.fsdp import release_mesh_groups

SMALL, LARGE = 64 << 10, 4 << 20  # bytes of the whole array: the latency, and the bandwidth
# bytes of a fresh buffer, all above fsdp's mmap threshold (128 KiB): two that hold no huge page (under 2 MiB: the
# rate of a 4 KiB page, 1.4-1.6 us each here) and one whose bytes past its first 2 MiB or so sit on huge pages
# (glibc.malloc.hugetlb=1 advises them; 0.5 us per 4 KiB of an 8 MiB buffer)
FRESH_SMALL, FRESH_MID, FRESH_LARGE = 256 << 10, 1536 << 10, 8 << 20
# Collectives are timed in sequences of this many, as a step issues them (a ddp step its buckets, an fsdp step
# three per group), and the sequences' 25th percentile kept, the quantile --measure keeps of whole steps. On the
# 2 development cores one all-reduce of 64 KiB between two bound processes took 0.22 ms at its 8th percentile
# (what each call was timed at before) but 0.37 at its median and 1.8 on average (a tail of waits for a
# woken process); a sequence of 8 read 1.0 ms per call at its 25th percentile, and ddp's steps pay that.
SEQUENCE = 8
# timed sequences per collective and size: with 15, three probes a minute apart on the idle development cores read
# the all-reduce's latency at 0.91-1.47 ms and the gathers' at 0.72-0.90; with 40, 0.87-0.99 and 0.93-0.97
# (about 3 s more), and one probe's constants serve every plan of the machine
SEQUENCES = 40
FSDP_GROUPS = 8  # tiny blocks of the in-group fsdp step (each gathered twice and reduce-scattered once a step)


def _collectives(kind: str) -> dict[str, float]:
    from multigpu.planning.timing import CPU_CLOCK, quantile_s

    def waits(fn: Callable[[], object]) -> float:
        """Seconds per call of a collective (it waits on the other process: wall time), timed in sequences."""
        return quantile_s(lambda: [fn() for _ in range(SEQUENCE)], SEQUENCES) / SEQUENCE

    def own(fn: Callable[[], object]) -> float:  # this thread alone (copies, page faults): its CPU time
        return quantile_s(fn, clock=CPU_CLOCK)

    world = dist.get_world_size()
    out: dict[str, float] = {}
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for label, nbytes in (("small", SMALL), ("large", LARGE)):
        n = nbytes // 4
        if kind == "allreduce":
            whole = torch.ones(n)
            out[f"allreduce_{label}_s"] = waits(lambda: dist.all_reduce(whole))  # noqa: B023 (called at once)
            continue
        shard = torch.ones(n // world)
        full = torch.ones(n)
        out[f"gather_{label}_s"] = waits(lambda: all_gather(torch.empty(n), shard))  # noqa: B023
        out[f"scatter_{label}_s"] = waits(lambda: reduce_scatter(torch.empty(n // world), full))  # noqa: B023
    if kind == "allreduce":
        from multigpu.planning.step_floors import ddp_step_s

        out["ddp_step_s"] = ddp_step_s(lambda nbytes: waits(lambda: dist.all_reduce(torch.ones(max(1, nbytes // 4)))))
    if kind == "sharded":
        out.update(_fsdp_steps(own))
        src = torch.ones(LARGE // 4)
        out["fresh_copy_s"] = own(lambda: torch.empty_like(src).copy_(src))
        for label, nbytes in (("small", FRESH_SMALL), ("mid", FRESH_MID), ("large", FRESH_LARGE)):
            warm = torch.empty(nbytes // 4)
            out[f"fresh_fill_{label}_s"] = own(lambda: torch.empty(nbytes // 4).fill_(1.0))  # noqa: B023
            out[f"warm_fill_{label}_s"] = own(lambda: warm.fill_(1.0))  # noqa: B023
    return out


def _fsdp_steps(own: Callable[[Callable[[], object]], float]) -> dict[str, float]:
    """Seconds of a training step (zero_grad, forward, backward, SGD with momentum) of :data:`FSDP_GROUPS`
    Linear(4, 4) blocks, each fully sharded over the group's processes (the root too), and unsharded:
    FSDP2's work per group as a real fsdp step pays it (the thread's CPU time: gloo's threads run the
    collectives, whose waits the plan charges as their latency). The one-process figure
    (:func:`multigpu.planning.calibrate.fsdp_group_s`) reads about half of it on the 2 development
    cores (0.87 against 1.65 ms per group at load 7): without a peer FSDP2 shards and copies nothing."""
    from torch.distributed.device_mesh import init_device_mesh

    from multigpu.planning.fsdp_probe_step import tiny_fsdp_step
    from multigpu.planning.step_floors import paired_s

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plain, sharded = tiny_fsdp_step(FSDP_GROUPS, None), tiny_fsdp_step(FSDP_GROUPS, mesh)
    plain_wall, sharded_wall = paired_s(plain, sharded)  # with the waits at every collective
    return {
        "fsdp_step_plain_s": own(plain),
        "fsdp_step_sharded_s": own(sharded),
        "fsdp_step_plain_wall_s": plain_wall,
        "fsdp_step_sharded_wall_s": sharded_wall,
    }


def main(argv: list[str]) -> None:
    rank, port, kind, out = int(argv[0]), int(argv[1]), argv[2], Path(argv[3])
    torch.set_num_threads(1)
    result: dict[str, float] = {}
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        dist.barrier()
        result.update(_collectives(kind))
        dist.barrier()
    finally:
        # the sharded probe's device mesh keeps the group's threads alive past its destruction, and one of
        # them aborted the process at exit now and then ("terminate called without an active exception")
        release_mesh_groups()
        dist.destroy_process_group()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
