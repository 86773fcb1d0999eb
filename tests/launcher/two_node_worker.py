"""Worker of the two-node tests: a small model trained step by step, checkpointed after every step.

    multigpu launch --strategy ddp --nnodes 2 ... tests/launcher/two_node_worker.py FOLDER STEPS

Resumes from FOLDER's latest checkpoint, trains to STEPS on global batch ``k`` of a fixed dataset
at step ``k`` (each rank its half), and writes one line per event to stdout: ``start <rank> <step>``
and ``step <rank> <step>``. Global rank 0 writes the final weights to FOLDER/final.pt.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import multigpu
from multigpu.session import Session

GLOBAL_BATCH = 8


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch ``step`` (the same data on every run)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=gen)
    y = x[:, :2] - 0.5 * x[:, 2:]
    return x[rank::world], y[rank::world]


def say(*words: object) -> None:
    os.write(1, (" ".join(map(str, words)) + "\n").encode())  # one write: lines of several workers stay whole


def main() -> None:
    folder, steps = Path(sys.argv[1]), int(sys.argv[2])
    with Session(strategy="ddp", seed=3) as session:
        model = session.setup_model(torch.nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        checkpoints = multigpu.Checkpointer(folder=folder, keep_last=2)
        resumed = checkpoints.resume(model=model, optimizer=optimizer)
        step = resumed.step if resumed else 0
        say("start", session.global_rank, step)
        while step < steps:
            x, y = batch(step, session.global_rank, session.world_size)
            with session.micro_step(model):
                session.backward(F.mse_loss(model(x), y))
            session.step(optimizer)
            step += 1
            checkpoints.save(step=step, model=model, optimizer=optimizer)
            say("step", session.global_rank, step)
            time.sleep(0.2)  # slow enough for a test to stop a node in the middle
        if session.is_main_process:
            torch.save(session.unwrap(model).state_dict(), folder / "final.pt")


if __name__ == "__main__":
    main()
