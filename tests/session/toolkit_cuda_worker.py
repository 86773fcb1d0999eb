"""The loop toolkit on CUDA with nccl (one process per GPU): collectives on device tensors, mid-epoch resume.

    multigpu launch --strategy ddp tests/session/toolkit_cuda_worker.py OUT_DIR

Rank 0 prints ``ok NAME`` per check passed (tests/session/test_toolkit.py reads them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multigpu import Checkpointer
from multigpu.session import Session


def train(folder: Path, *, stop_at: int | None) -> dict[str, torch.Tensor] | None:
    with Session(strategy="ddp", seed=0) as session:
        model = session.setup_model(nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(3)
        data = TensorDataset(torch.randn(48, 5, generator=gen), torch.randint(0, 3, (48,), generator=gen))
        loader = session.build_loader(data, batch_size=4 * session.world_size)
        checkpointer = Checkpointer(folder=folder)
        resumed = checkpointer.resume(model=model, optimizer=optimizer, loader=loader)
        step = resumed.step if resumed else 0
        while step < 14:
            for x, y in session.batches(loader):
                with session.micro_step(model):
                    session.backward(F.cross_entropy(model(x), y))
                session.step(optimizer)
                step += 1
                if step == stop_at:
                    checkpointer.save(step=step, model=model, optimizer=optimizer, loader=loader)
                    return None
                if step == 14:
                    break
        return {k: v.detach().cpu().clone() for k, v in session.unwrap(model).state_dict().items()}


def main() -> None:
    out = Path(sys.argv[1])
    with Session(strategy="ddp", seed=0) as session:
        world, rank, device = session.world_size, session.global_rank, session.device
        assert device.type == "cuda", device
        got = session.gather({"t": torch.arange(rank + 1, device=device)})["t"]
        want = torch.cat([torch.arange(r + 1) for r in range(world)])
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want), got
        assert session.gather_object(rank) == list(range(world))
        assert torch.equal(session.broadcast(torch.full((2,), float(rank), device=device)).cpu(), torch.zeros(2))
        assert session.broadcast_object({"r": rank}) == {"r": 0}
        reduced = session.reduce({"v": torch.ones(3, device=device)}, "sum")["v"]
        assert reduced.device.type == "cuda" and torch.equal(reduced.cpu(), torch.full((3,), float(world)))
        padded = session.pad_across_processes(torch.ones(rank + 1, device=device))
        assert padded.shape == (world,) and padded.device.type == "cuda"
        n = 4 * world + 1
        loader = session.setup_dataloader(DataLoader(TensorDataset(torch.arange(n)), batch_size=2 * world))
        ids = torch.cat([session.gather_for_metrics(i) for (i,) in session.batches(loader)])
        assert torch.equal(ids.cpu(), torch.arange(n)), ids
        session.print("ok cuda_collectives")
        # each run a session of its own inside this one's process group (sessions started after a
        # group was torn down would have to rendezvous again)
        whole = train(out / "whole", stop_at=None)
        train(out / "split", stop_at=8)
        rest = train(out / "split", stop_at=None)
        assert whole is not None and rest is not None
        assert all(torch.equal(whole[k], rest[k]) for k in whole), "resume mid-epoch on CUDA"
        session.print("ok cuda_resume")


if __name__ == "__main__":
    main()
