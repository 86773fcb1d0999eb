"""Worker of the scheduler-start and pre-emption tests: a small model trained step by step.

    python tests/runtime/preempt_worker.py FOLDER STEPS [slow]          (under srun/mpirun variables)
    multigpu launch --strategy ddp ... tests/runtime/preempt_worker.py FOLDER STEPS [slow]

Resumes from FOLDER's latest checkpoint, trains to STEPS on global batch ``k`` of a fixed dataset at
step ``k`` (each rank its share), and after every step reads ``session.should_stop``: when the ranks
agree to stop it saves a checkpoint and leaves the loop. Writes one line per event to stdout:
``world <rank> <world_size> <scheduler>``, ``step <rank> <step>``, ``stopped <rank> <step>``. Global rank 0
writes the final weights to FOLDER/final.pt when it reaches STEPS. ``slow`` sleeps after each step, so
that a test can signal it in the middle. :func:`oracle` is the same training on one device in plain torch.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import multigpu
from multigpu.runtime.world import read_launch_env
from multigpu.session import Session

GLOBAL_BATCH = 8
SEED = 3


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch ``step`` (the same data on every run)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=gen)
    y = x[:, :2] - 0.5 * x[:, 2:]
    return x[rank::world], y[rank::world]


def oracle(steps: int) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` steps on one device, plain torch, same seed and global batches."""
    torch.manual_seed(SEED)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def say(*words: object) -> None:
    os.write(1, (" ".join(map(str, words)) + "\n").encode())  # one write: lines of several workers stay whole


def main() -> None:
    folder, steps, slow = Path(sys.argv[1]), int(sys.argv[2]), "slow" in sys.argv[3:]
    with Session(strategy="ddp", seed=SEED) as session:
        env = read_launch_env()
        say("world", session.global_rank, session.world_size, env.scheduler if env else "-")
        model = session.setup_model(torch.nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        checkpoints = multigpu.Checkpointer(folder=folder, keep_last=2)
        resumed = checkpoints.resume(model=model, optimizer=optimizer)
        step = resumed.step if resumed else 0
        while step < steps:
            x, y = batch(step, session.global_rank, session.world_size)
            with session.micro_step(model):
                session.backward(F.mse_loss(model(x), y))
            session.step(optimizer)
            step += 1
            stop = session.should_stop  # every rank, after every step: agreed on one step
            say("step", session.global_rank, step)  # (after the first read: the handlers are in)
            if stop:
                checkpoints.save(step=step, model=model, optimizer=optimizer)
                say("stopped", session.global_rank, step)
                return
            if slow:
                time.sleep(0.3)  # slow enough for a test to signal the run in the middle
        if session.is_main_process:
            torch.save(session.unwrap(model).state_dict(), folder / "final.pt")


if __name__ == "__main__":
    main()
