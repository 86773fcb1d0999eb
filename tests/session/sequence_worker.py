"""Worker: several Sessions one after the other in one process, each creating and destroying its own group.

    multigpu launch --strategy ddp --nproc-per-node 2 tests/session/sequence_worker.py OUT_DIR STRATEGY...

One Session per STRATEGY argument (``ddp`` or ``fsdp``), in order; each joins a process group of its own,
trains two steps and closes it. Rank R writes OUT_DIR/rank<R>.pt: per Session, its strategy and which
ranks its all-reduces counted, and whether a wrapped model the script dropped inside a reference cycle
was collected by the close (the collection that lets go of what such models hold of the group), which
must still see it under the entry's frozen objects: ``frozen``, how many there were when the script started.
A Session that met the previous group's rendezvous keys hung here until the timeout.
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from multigpu.runtime import world
from multigpu.session import Session


def one_session(strategy: str) -> dict[str, object]:
    with Session(strategy=strategy, timeout_s=40) as session:  # a hang fails in 40 s, not in ten minutes
        assert dist.is_initialized()
        # ddp: the dropped model is wrapped last (the close's loop over the models held the last one through
        # its collection); fsdp: first, as the Session keeps the last model set up (fully_shard wraps in place)
        if strategy == "fsdp":
            gone = _dropped_in_a_cycle(session)
        model = session.setup_model(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
        if strategy != "fsdp":
            gone = _dropped_in_a_cycle(session)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            with session.micro_step(model):
                session.backward(model(torch.randn(4, 8)).square().mean())
            session.step(optimizer)
        ranks = torch.tensor([session.reduce(torch.tensor(float(session.global_rank == r)), "sum") for r in (0, 1)])
        name = session.strategy_name
        gc.disable()  # only the close collects the dropped model (not a collection its own allocations start)
    try:
        collected = gone() is None
    finally:
        gc.enable()
    state = model.state_dict()  # the model still reads after its group closed (fsdp: its local shards)
    return {"strategy": name, "ranks": ranks.int().tolist(), "weights": len(state), "collected": collected}


def _dropped_in_a_cycle(session: Session) -> weakref.ref[nn.Module]:
    """A model wrapped by ``session`` and dropped at once, inside a reference cycle; a weak reference to it."""
    dropped = session.setup_model(nn.Linear(8, 2))
    dropped.cycle = [dropped]  # type: ignore[assignment]
    return weakref.ref(dropped)


def main() -> None:
    out, strategies = Path(sys.argv[1]), sys.argv[2:]
    frozen = gc.get_freeze_count()  # what the launcher's entry froze before this script started
    results = []
    for strategy in strategies:
        results.append(one_session(strategy))
    assert not dist.is_initialized()  # every Session closed the group it created
    torch.save({"frozen": frozen, "sessions": results}, out / f"rank{world.global_rank()}.pt")


if __name__ == "__main__":
    main()
