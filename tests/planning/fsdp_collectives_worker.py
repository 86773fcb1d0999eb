"""Worker: the collectives one fsdp training step of a small CNN issues, as torch's profiler records them.

    multigpu launch --strategy fsdp --nproc-per-node 2 tests/planning/fsdp_collectives_worker.py OUT.json

Two warm-up steps, then one step under ``torch.profiler``: every c10d all-gather and reduce-scatter
it records is counted (the ops torch.distributed dispatches, whatever FSDP2 calls them through).
Rank 0 writes the counts and the module's fsdp groups as the planner counts them.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests` imports

from multigpu.session import Session
from tests.planning._reference_nets import small_cnn

KINDS = {"all_gather": "all-gather", "allgather": "all-gather", "reduce_scatter": "reduce-scatter"}


def _kind(name: str) -> str | None:
    lowered = name.lower()
    if not lowered.startswith("c10d::"):
        return None
    return next((kind for key, kind in KINDS.items() if key in lowered), None)


def main(out: Path) -> None:
    torch.manual_seed(0)
    with Session(strategy="fsdp") as session:
        model = session.setup_model(small_cnn())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(8, 3, 32, 32)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            session.backward(model(x).pow(2).mean())
            optimizer.step()

        step()
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        counts = Counter(k for e in prof.events() if (k := _kind(e.name)) is not None)
        names = sorted({e.name for e in prof.events() if _kind(e.name)})
        if session.is_main_process:
            out.write_text(json.dumps({"counts": dict(counts), "names": names}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
