"""One rank of the all-reduce probe: started by :func:`multigpu.launcher.allreduce_probe.probe_all_reduce`.

The worker's half of the probe (the launching half lives in the launcher, above profiling).

Run through the launcher (``multigpu launch --strategy ddp``'s path), never by hand::

    launch(LaunchConfig(strategy="ddp", nproc_per_node=2), __file__, [out_folder])

It reads what to time from ``out_folder/probe.json``, joins the process group the runtime sets up
(gloo on the CPU, the device type's backend on an accelerator), times ``all_reduce`` of each size
back to back and writes ``out_folder/rank<R>.json``: seconds per operation, one per size.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from multigpu.devices import backend_device_type, synchronizer
from multigpu.profiling.bandwidth import iters_for, time_per_op
from multigpu.runtime import world


def main(out: Path) -> None:
    spec = json.loads((out / "probe.json").read_text())
    env = world.require_launch_env("the all-reduce probe")
    # a backend of an accelerator's processes (nccl: cuda) all-reduces on this process's device, the CPU's on the CPU
    device = world.process_device(env) if backend_device_type(spec["backend"]) is not None else torch.device("cpu")
    world.setup_process_group(env, device, timeout_s=world.collective_timeout_s())
    try:
        sync = synchronizer([device])
        seconds = []
        for size in spec["sizes"]:
            if time.time() > spec["deadline"]:
                raise TimeoutError(f"the all-reduce probe ran past its deadline before size {size}")
            tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
            dist.barrier()
            # the count depends on the size only: every rank runs the same number of collectives
            iters = iters_for(size, max_iters=spec["max_iters"])
            seconds.append(time_per_op(lambda: dist.all_reduce(tensor), sync, iters=iters, repeats=spec["repeats"]))  # noqa: B023 (called at once, inside this iteration)
        (out / f"rank{env.global_rank}.json").write_text(json.dumps(seconds))
    finally:
        world.teardown_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
