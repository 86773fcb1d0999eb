"""Worker of the DDP profile tests: one rank of a small DDP run with one slow rank (on the CPU).

    multigpu launch --strategy ddp --nproc-per-node 2 tests/profiling/ddp_worker.py OUT.json

Joins the process group the runtime sets up (gloo on the CPU, nccl on CUDA), trains ``STEPS``
steps under ``profile_ddp`` (rank ``SLOW_RANK`` sleeps ``DELAY_S`` before each step on the CPU) and
rank 0 writes the gathered profile to OUT.json.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multigpu.profiling.ddp import profile_ddp
from multigpu.runtime import collectives
from multigpu.runtime import world as runtime

STEPS, WARMUP, SLOW_RANK, DELAY_S = 4, 1, 1, 0.08


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def main(out: Path) -> None:
    torch.set_num_threads(1)
    env = runtime.require_launch_env("the DDP profile test")
    device = runtime.process_device(env)
    runtime.setup_process_group(env, device, timeout_s=60)
    try:
        model = DistributedDataParallel(net().to(device), device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(16, 32, device=device), torch.randint(0, 4, (16,), device=device)
        with profile_ddp(model, optimizer=opt, warmup=WARMUP) as prof:
            for _ in range(WARMUP + STEPS):
                if env.global_rank == SLOW_RANK and device.type == "cpu":
                    time.sleep(DELAY_S)  # this rank computes slower: the other one waits in the all-reduce
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        profile = prof.gather()
        if runtime.is_main_process():
            out.write_text(profile.to_json())
        collectives.barrier()
        # Free DDP's reducer (it holds the process group and the comm hook) before the group goes:
        # tearing the group down under a live reducer can abort the process at exit.
        del model, prof, opt
        gc.collect()
    finally:
        runtime.teardown_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
