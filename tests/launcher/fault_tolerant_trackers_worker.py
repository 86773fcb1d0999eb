"""A fault-tolerant replica group's script that logs to trackers, for tests/launcher/test_fault_tolerant_trackers.py.

    multigpu launch --strategy ddp --fault-tolerant --replicas 2 --nproc-per-node 1 --max-restarts 1 \
        tests/launcher/fault_tolerant_trackers_worker.py OUT_DIR SLEEP_S TRACKER,TRACKER...

The worker runs in OUT_DIR, without ``run_dir``: the run folder is the default one there, with the trackers named (MLflow's store: ``OUT_DIR/mlflow.db``). After each
committed step the worker appends ``{"global_step", "pid"}`` to ``OUT_DIR/group<g>.jsonl``, then logs ``pid`` (its
process id) at ``session.global_step`` (only the main process, rank 0 of group 0, writes). Each step sleeps
SLEEP_S while ``OUT_DIR/hold`` exists; the run ends at the step ``OUT_DIR/total`` names (read at every step, so
that a test ends both groups together once it has seen what it waits for).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from multigpu.session import Session


def total(out: Path) -> int:
    text = (out / "total").read_text().strip() if (out / "total").exists() else ""
    return int(text) if text else 10**6


def main() -> None:
    out, pause, trackers = Path(sys.argv[1]).resolve(), float(sys.argv[2]), tuple(sys.argv[3].split(","))
    os.chdir(out)  # the default run folder, runs/<...>, goes there
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator)
    )
    options = {"mlflow": {"tracking_uri": f"sqlite:///{out / 'mlflow.db'}"}} if "mlflow" in trackers else {}
    with Session(strategy="ddp", run_name="ft", trackers=trackers, tracker_options=options) as session:
        model = session.setup_model(nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = session.build_loader(data, batch_size=8)
        with (out / f"group{session.replica_group}.jsonl").open("a") as steps:
            while session.global_step < total(out):
                for x, y in session.batches(loader):
                    with session.micro_step(model):
                        session.backward(nn.functional.mse_loss(model(x), y))
                        if (out / "hold").exists():
                            time.sleep(pause)
                    if session.step(optimizer):  # a step no group committed is not logged (global_step stays)
                        steps.write(json.dumps({"global_step": session.global_step, "pid": os.getpid()}) + "\n")
                        steps.flush()  # before the log: a kill in between leaves the step here, not in the trackers
                        session.log({"pid": float(os.getpid())}, session.global_step)
                    if session.global_step >= total(out):
                        break


if __name__ == "__main__":
    main()
