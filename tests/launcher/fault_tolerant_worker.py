"""A fault-tolerant replica group's training script for tests/launcher/test_fault_tolerant.py.

    multigpu launch --strategy ddp --fault-tolerant --replicas 2 --nproc-per-node 1 \
        tests/launcher/fault_tolerant_worker.py OUT_DIR STEPS [SLEEP_S]

Each step sleeps SLEEP_S inside its micro-step (a kill then lands inside the step) while the file
``OUT_DIR/hold`` exists, so that a test can keep the run going until a restarted group is back.

Each step reads ``session.should_stop``: once a SIGTERM has stopped the group, the worker writes
``OUT_DIR/stopped-group<g>-<pid>.json`` (its ``global_step``) and returns, as a script that saves there would.

Each worker appends one JSON line per ``session.step`` to ``OUT_DIR/group<g>-rank<r>.jsonl``: the group,
the step's result, ``global_step``, the digest of the weights after the step and the weights, the loader's position, the
first sample of the batch it trained and the dataset indices of its samples, the digest of torch's random state after
the step, the pid, the parent's pid, the time, how many quorums the group has run and whether DDP's reducer summed the step's
buckets across groups in backward (``in_backward``; else they were summed after it). A test kills workers by pid from these lines.

``OUT_DIR/fail`` holding ``G K``: group G's step at ``global_step`` K fails once after its cross-group all-reduce
went through on every group (its Manager records an error there), as when a peer dies inside the all-reduce
and the ring completes on one group but not on another.

``OUT_DIR/scheduler`` holding ``S G``: the script steps a ``StepLR(optimizer, step_size=S, gamma=G)`` after each
committed step (each record then has the learning rate and the scheduler's ``last_epoch``). ``OUT_DIR/raw``: the loop
iterates the loader itself (``for x, y in loader``) instead of ``session.batches(loader)``. ``OUT_DIR/interval`` holding
``S``: a quorum runs at least every S seconds (``multigpu.runtime.replica_groups.QUORUM_INTERVAL_S``).

``OUT_DIR/find_unused``: the model is wrapped with ``DDPOptions(find_unused_parameters=True)``.

``OUT_DIR/stall`` holding ``G K S``: group G's script sleeps S seconds once, between steps, after the first step that
made ``global_step`` K or more and after which a quorum is due (its Manager's heartbeat goes on): longer than the
lighthouse's join timeout, the other groups go on without it and it falls behind while alive. After its next step it removes ``OUT_DIR/hold``: the others, held at SLEEP_S a
step until it was back, run the rest at full speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from multigpu.runtime import replica_groups
from multigpu.session import Session
from multigpu.strategies import DDPOptions


def digest(model: nn.Module) -> str:
    hasher = hashlib.sha256()
    for tensor in model.state_dict().values():
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()[:16]


def fail_after_the_all_reduce(session: Session) -> None:
    """This group's next step fails here only, once its gradients' all-reduce completed on every group."""
    sync = session._replicas
    assert sync is not None
    average = sync.average_gradients

    def average_then_fail(params: list[torch.Tensor]) -> None:
        average(params)
        sync._manager.report_error(RuntimeError("the test's failure after the all-reduce, on this group only"))
        sync.average_gradients = average  # type: ignore[method-assign]

    sync.average_gradients = average_then_fail  # type: ignore[method-assign]


def main() -> None:
    out, total = Path(sys.argv[1]), int(sys.argv[2])
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    started = time.time()
    if (out / "crash").exists():  # every group dead: a script that fails at its start, every time
        raise RuntimeError("this replica group's script fails at its start (the test's crash file)")
    fail = tuple(int(v) for v in (out / "fail").read_text().split()) if (out / "fail").exists() else None
    stall = [float(v) for v in (out / "stall").read_text().split()] if (out / "stall").exists() else None
    steplr = (out / "scheduler").read_text().split() if (out / "scheduler").exists() else None
    raw = (out / "raw").exists()
    if (out / "interval").exists():  # the longest stretch without a quorum (when none is due for another reason)
        replica_groups.QUORUM_INTERVAL_S = float((out / "interval").read_text())
    stalled = False  # this group's stall is over: release the others' hold after its next step
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(240, 8, generator=generator), torch.randn(240, 1, generator=generator)
    )
    index = {float(v): i for i, v in enumerate(data.tensors[0][:, 0])}  # a sample's first feature names it
    unused = (out / "find_unused").exists()  # DDP looks for unused parameters (its buckets are never rebuilt)
    with Session(strategy="ddp", ddp=DDPOptions(find_unused_parameters=unused)) as session:
        model = session.setup_model(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scheduler = None
        if steplr is not None:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=int(steplr[0]), gamma=float(steplr[1]))
        loader = session.build_loader(data, batch_size=24)
        path = out / f"group{session.replica_group}-rank{session.rank}.jsonl"
        with path.open("a") as log:
            while session.global_step < total:
                for x, y in loader if raw else session.batches(loader):
                    with session.micro_step(model):
                        loss = nn.functional.mse_loss(model(x), y)
                        session.backward(loss)
                        if (out / "hold").exists():
                            time.sleep(pause)
                    if fail is not None and (session.replica_group, session.global_step) == fail:
                        fail = None
                        fail_after_the_all_reduce(session)
                    committed = session.step(optimizer)
                    if committed and scheduler is not None:
                        scheduler.step()
                    record = {
                        "group": session.replica_group,
                        "committed": committed,
                        "global_step": session.global_step,
                        "digest": digest(session.unwrap(model)),
                        "weights": [float(v) for v in nn.utils.parameters_to_vector(model.parameters()).detach()],
                        "position": loader.state_dict()["batch"],
                        "epoch": loader.state_dict()["epoch"],
                        "first": float(x[0, 0]),
                        "samples": [index[float(v)] for v in x[:, 0]],
                        "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16],
                        "lr": optimizer.param_groups[0]["lr"],
                        "schedule": None if scheduler is None else scheduler.last_epoch,
                        "pid": os.getpid(),
                        "ppid": os.getppid(),
                        "quorums": None if session._replicas is None else session._replicas.quorums,
                        "in_backward": None if session._replicas is None else session._replicas._summing,
                        "started": started,
                        "time": time.time(),
                    }
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    if session.should_stop:  # SIGTERM (the launcher's, or this group's alone): leave, as a save would
                        stopped = {"global_step": session.global_step, "pid": os.getpid()}
                        (out / f"stopped-group{session.replica_group}-{os.getpid()}.json").write_text(
                            json.dumps(stopped)
                        )
                        return
                    if session.global_step >= total:
                        break
                    if stalled:
                        (out / "hold").unlink(missing_ok=True)
                        stalled = False
                    due = session._replicas is not None and session._replicas.quorum_due  # the next step runs one
                    if stall and due and session.replica_group == stall[0] and session.global_step >= stall[1]:
                        time.sleep(stall[2])  # between steps, before a quorum: it goes on without this group
                        stall, stalled = None, True


if __name__ == "__main__":
    main()
