"""Worker: several Sessions one after the other in one process, each creating and destroying its own group.

    multigpu launch --strategy ddp --nproc-per-node 2 tests/session/sequence_worker.py OUT_DIR STRATEGY...

One Session per STRATEGY argument (``ddp`` or ``fsdp``), in order; each joins a process group of its own,
trains two steps and closes it. Rank R writes OUT_DIR/rank<R>.pt: per Session, its strategy and which
ranks its all-reduces counted. A Session that met the previous group's
rendezvous keys hung here until the timeout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from multigpu.runtime import world
from multigpu.session import Session


def one_session(strategy: str) -> dict[str, object]:
    with Session(strategy=strategy, timeout_s=40) as session:  # a hang fails in 40 s, not in ten minutes
        assert dist.is_initialized()
        model = session.setup_model(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            with session.micro_step(model):
                session.backward(model(torch.randn(4, 8)).square().mean())
            session.step(optimizer)
        ranks = torch.tensor([session.reduce(torch.tensor(float(session.global_rank == r)), "sum") for r in (0, 1)])
        name = session.strategy_name
    state = model.state_dict()  # the model still reads after its group closed (fsdp: its local shards)
    return {"strategy": name, "ranks": ranks.int().tolist(), "weights": len(state)}


def main() -> None:
    out, strategies = Path(sys.argv[1]), sys.argv[2:]
    results = []
    for strategy in strategies:
        results.append(one_session(strategy))
    assert not dist.is_initialized()  # every Session closed the group it created
    torch.save(results, out / f"rank{world.global_rank()}.pt")


if __name__ == "__main__":
    main()
