"""Train to a step under ``multigpu launch`` (ddp or fsdp, any world size), resuming from the latest checkpoint.

    multigpu launch --strategy ddp --nproc-per-node 3 world_size_worker.py --folder CKPT --out OUT --until 4

A global batch of 6 (it divides by 2 and 3 ranks), a model without dropout, momentum SGD, a session
loader saved with ``loader=``. Every rank writes the sample indices it trained on at each step to
``OUT/samples-step<S>-rank<R>.txt``; at the end the run saves a checkpoint of ``--until`` (the test
reads its weights with ``multigpu.load``, which reads a sharded step folder whole).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: `tests` imports

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from multigpu import Checkpointer, Session

GLOBAL_BATCH = 6
SAMPLES = 60  # 10 batches an epoch


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--until", type=int, required=True)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    with Session(strategy=args.strategy, seed=0) as session:
        data = torch.Generator().manual_seed(7)
        x = torch.randn(SAMPLES, 8, generator=data)
        y = x @ torch.randn(8, 1, generator=data) + 0.1 * torch.randn(SAMPLES, 1, generator=data)
        dataset = TensorDataset(x, y, torch.arange(SAMPLES))
        model = session.setup_model(build_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = session.build_loader(dataset, batch_size=GLOBAL_BATCH, shuffle=True)
        checkpointer = Checkpointer(folder=args.folder, keep_last=None)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="resuming at world_size=")  # no dropout: nothing random
            resumed = checkpointer.resume(model=model, optimizer=optimizer, loader=loader)
        step = resumed.step if resumed else 0
        rank = session.global_rank
        while step < args.until:
            for xb, yb, index in session.batches(loader):
                with session.micro_step(model):
                    session.backward(F.mse_loss(model(xb), yb))
                session.step(optimizer)
                step += 1
                (args.out / f"samples-step{step}-rank{rank}.txt").write_text(" ".join(map(str, index.tolist())))
                if step == args.until:
                    break
        checkpointer.save(step=step, model=model, optimizer=optimizer, loader=loader)
        # The fsdp model is still alive as the session closes: before the Session released the device mesh's
        # hold on the group (strategies/fsdp.py, release_mesh_groups), this worker aborted at exit ("terminate
        # called without an active exception") in 5 of 8 launches; the three launches of the fsdp case see it.


if __name__ == "__main__":
    main()
