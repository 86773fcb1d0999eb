"""Worker of the slow-rank tests: three Sessions one after the other, a healthy one and two with a slow rank 1.

    multigpu launch --strategy ddp --nproc-per-node 2 tests/runtime/straggler_worker.py OUT STEPS BASE_S FACTOR

Every rank's step sleeps BASE_S seconds (the sleep stands for compute; the model is tiny, so the steps are
made of the sleeps). In OUT/healthy every rank does, for STEPS steps. Rank 1 is throttled in the others: its
own work (all but the backward, whose all-reduce the watch counts as waiting) takes FACTOR times as long, as
on a device FACTOR times slower: in OUT/slow (STEPS steps) it sleeps (FACTOR - 1) times its step's own work
so far before its backward; in OUT/slow-data (50 steps) its loader sleeps (FACTOR - 1) times the last step's
own work before each batch. ``session.log`` every 10 steps writes OUT/<run>/metrics.csv.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from multigpu.session import Session

out, steps, base_s, factor = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])


def loader(count: int, slow_by: float, work: list[float]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches, each after a sleep of ``slow_by`` times ``work[0]``; ``work[1]`` adds the time slept."""
    for _ in range(count):
        began = time.perf_counter()
        time.sleep(slow_by * work[0])
        work[1] += time.perf_counter() - began
        yield torch.randn(4, 8), torch.randn(4, 1)


for run, count in (("healthy", steps), ("slow", steps), ("slow-data", 50)):
    with Session(strategy="ddp", run_dir=out / run) as session:
        model = session.setup_model(nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        slow = session.global_rank == 1
        work = [base_s, 0.0]  # the last step's own work without its data wait; the loader's sleeps since
        batches = loader(count, factor - 1 if slow and run == "slow-data" else 0.0, work)
        mark, stepping = time.perf_counter(), 0.0  # the last session.step's time (a part of the own work)
        for step, (x, y) in enumerate(session.batches(batches), start=1):
            with session.micro_step(model):
                time.sleep(base_s)
                loss = F.mse_loss(model(x), y)
                if slow and run == "slow":
                    time.sleep((factor - 1) * (time.perf_counter() - mark - work[1] + stepping))
                before = time.perf_counter()
                session.backward(loss)
                after = time.perf_counter()
            session.step(optimizer)
            stepping = time.perf_counter() - after
            work[:] = [before - mark - work[1] + stepping, 0.0]
            mark = time.perf_counter()
            if step % 10 == 0:
                session.log({"loss": loss.detach()}, step)
