"""Worker of the slow-rank tests: two Sessions one after the other, a healthy one and one with a slow rank.

    multigpu launch --strategy ddp --nproc-per-node 2 tests/runtime/straggler_worker.py OUT STEPS BASE_S FACTOR

Every rank's step sleeps BASE_S seconds (the sleep stands for compute: a throttled device sleeps in effect;
the model is tiny, so the steps are made of the sleeps). In OUT/healthy every rank does; in OUT/slow rank 1
sleeps FACTOR times as long. ``session.log`` every 10 steps and after the last writes OUT/<run>/metrics.csv.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from multigpu.session import Session

out, steps, base_s, factor = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])

for run, slow_rank in (("healthy", None), ("slow", 1)):
    with Session(strategy="ddp", run_dir=out / run) as session:
        model = session.setup_model(nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(steps)]
        pause = base_s * (factor if session.global_rank == slow_rank else 1.0)
        for step, (x, y) in enumerate(session.batches(batches), start=1):
            with session.micro_step(model):
                time.sleep(pause)
                loss = F.mse_loss(model(x), y)
                session.backward(loss)
            session.step(optimizer)
            if step % 10 == 0 or step == steps:
                session.log({"loss": loss.detach()}, step)
