"""A training script in which one rank goes wrong, as a user's would (tests/launcher/test_forensics.py).

    multigpu launch --strategy ddp --nproc-per-node 2 --collective-timeout 4 forensics_worker.py sleep 1

Modes: ``sleep``, ``busy``, ``native`` (rank R is stuck before the second reduce: in time.sleep, in a
Python loop, in a C call); ``shape`` (rank 0 reduces 3 values, rank 1 five: the session refuses it);
``raw_shape`` (the same through torch.distributed itself, which gloo aborts); ``order`` (rank 0
reduces where rank 1 waits at a barrier); ``unused`` (a parameter gets no gradient under ddp);
``print`` (each rank prints one line to stdout and one to stderr).
"""

from __future__ import annotations

import ctypes
import sys
import time

import torch
from torch import nn

from multigpu.session import Session


def stuck_in_sleep() -> None:
    time.sleep(120)  # STUCK: sleep


def stuck_in_busy_loop() -> None:
    count, deadline = 0, time.monotonic() + 120
    while time.monotonic() < deadline:
        count += 1


def stuck_in_native_code() -> None:
    remaining = 120
    while remaining:  # as C code does: a signal ends sleep() early, so sleep the rest
        remaining = ctypes.CDLL(None).sleep(remaining)  # STUCK: native


STUCK = {"sleep": stuck_in_sleep, "busy": stuck_in_busy_loop, "native": stuck_in_native_code}


class WithSpareHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.spare = nn.Sequential(nn.Linear(4, 2))  # never used by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def main(mode: str, stuck_rank: int) -> None:
    with Session(strategy="ddp") as session:
        session.reduce(1.0)  # every rank is up
        rank = session.global_rank
        if mode in STUCK and rank == stuck_rank:
            STUCK[mode]()
        if mode in STUCK:
            session.reduce(2.0)  # WAITED IN
        elif mode == "shape":
            session.reduce(torch.ones(3 if rank == 0 else 5).sum(), "sum")  # sanity: same shape, fine
            session.reduce(torch.ones(3 if rank == 0 else 5))  # MISMATCH: shape
        elif mode == "raw_shape":
            torch.distributed.all_reduce(torch.ones(3 if rank == 0 else 5))  # MISMATCH: raw shape
        elif mode == "order":
            if rank == 0:
                session.reduce(2.0)  # MISMATCH: reduce
            else:
                session.barrier()  # MISMATCH: barrier
        elif mode == "unused":
            model = session.setup_model(WithSpareHead())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                with session.micro_step(model):
                    session.backward(model(torch.randn(8, 4)).sum())
                session.step(optimizer)
        elif mode == "print":
            print(f"stdout of rank {rank}", flush=True)
            print(f"stderr of rank {rank}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
