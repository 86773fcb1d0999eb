"""The loop toolkit on CUDA with nccl (one process per GPU): collectives on device tensors, mid-epoch resume.

    multigpu launch --strategy ddp tests/session/toolkit_cuda_worker.py OUT_DIR

Rank 0 prints ``ok NAME`` per check passed (tests/session/test_toolkit.py reads them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from toolkit_worker import train_with_dropout  # beside this file (its folder is on the path)
from torch.utils.data import DataLoader, TensorDataset

from multigpu.session import Session


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
        whole = train_with_dropout(out / "whole", stop_at=None)
        train_with_dropout(out / "split", stop_at=8)
        rest = train_with_dropout(out / "split", stop_at=None)
        assert whole is not None and rest is not None
        assert all(torch.equal(whole[k], rest[k]) for k in whole), "resume mid-epoch on CUDA"
        session.print("ok cuda_resume")


if __name__ == "__main__":
    main()
