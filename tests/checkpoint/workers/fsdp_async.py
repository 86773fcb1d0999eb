"""Asynchronous saves under fsdp, 2 ranks, one launch (tests/checkpoint/test_async_save.py):

    multigpu launch --strategy fsdp --nproc-per-node 2 --max-restarts 1 fsdp_async.py FOLDER OUT

First attempt: (1) save step 1 asynchronously; the model changes at once (one more step) and rank R
records what it had at the save (OUT/expected-rank<R>.pt: its slices, its next random draws).
(2) Rank 1's file size is limited (SIGXFSZ ignored): the background write of step 2 fails, raised
by the next ``save`` (step 3), then again by ``wait``; each rank writes what it got to
OUT/failure-rank<R>.txt, with the steps then on disk. (3) With the limit lifted, rank 1 SIGKILLs
itself at its first file-system event inside FOLDER during the write of step 2 (OUT/killed.txt:
the event and the thread it came from), after ``save`` returned (OUT/returned-rank1.txt).

Second attempt (the launcher's restart): (4) resume (OUT/resumed-rank<R>.pt: the step, this rank's
slices, its random draws); (5) train and save each step asynchronously until ``session.should_stop``
(rank 1 sends itself SIGTERM after step 2), each rank's write slowed at its first file-system event
in FOLDER; leave without ``wait`` or ``close``: the session's end must wait for the write before it
closes the process group (OUT/stopped.txt: the last step saved).
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: `tests` imports

import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.errors import CheckpointError
from multigpu.runtime.world import restart_count
from multigpu.session import Session
from tests.checkpoint import _sharded as sh

LIMIT = 256 << 10  # rank 1's shard is about 4 MiB


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    optimizer.zero_grad()
    x = torch.randn(8, 64) + rank
    nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,))).backward()
    optimizer.step()


class Events:
    """This process's file-system events inside one folder: SIGKILL at the first, or a pause there."""

    def __init__(self, folder: Path, out: Path) -> None:
        self.root, self.out = str(folder.resolve()), out
        self.kill = self.pause = False
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event not in ("open", "os.rename", "os.mkdir") or not args or not isinstance(args[0], (str, os.PathLike)):
            return
        if not os.path.abspath(os.fspath(args[0])).startswith(self.root):
            return
        if self.kill:
            with open(self.out / "killed.txt", "w") as f:  # outside the folder: not an event of ours
                f.write(f"{event} {args[0]} {threading.current_thread().name}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.pause:
            self.pause = False
            time.sleep(0.5)  # the session is closing meanwhile: it must wait for this write


def start(session: Session, folder: Path, out: Path) -> tuple[int, Events, Any, torch.optim.Optimizer, Any]:
    """What both attempts begin with: this rank, its event log, the model, its optimizer, an async Checkpointer."""
    model = session.setup_model(build())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    checkpointer = ckpt.Checkpointer(folder=folder, keep_last=2, async_save=True)
    return session.global_rank, Events(folder, out), model, optimizer, checkpointer


def first_attempt(session: Session, folder: Path, out: Path) -> None:
    rank, events, model, optimizer, checkpointer = start(session, folder, out)
    step(model, optimizer, rank)
    expected = {"model": sh.local(model.state_dict()), "optimizer": sh.local(optimizer.state_dict())}
    checkpointer.save(step=1, model=model, optimizer=optimizer)
    expected["draws"] = sh.random_draws()
    torch.save(expected, out / f"expected-rank{rank}.pt")
    step(model, optimizer, rank)  # while the write runs
    checkpointer.wait()

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    lines = []
    for where, after in (
        ("save", lambda: checkpointer.save(step=3, model=model, optimizer=optimizer)),
        ("wait", checkpointer.wait),
    ):
        checkpointer.save(step=2, model=model, optimizer=optimizer)
        try:
            after()
            lines.append(f"{where}: no error")
        except CheckpointError as exc:
            lines.append(f"{where}: {' '.join(str(exc).split())}")
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    lines.append(f"steps: {checkpointer.steps()} latest: {checkpointer.latest()}")
    (out / f"failure-rank{rank}.txt").write_text("\n".join(lines) + "\n")

    events.kill = rank == 1
    checkpointer.save(step=2, model=model, optimizer=optimizer)
    if rank == 1:
        (out / "returned-rank1.txt").write_text("returned\n")
    checkpointer.wait()  # rank 1 dies in its write; rank 0 waits here until the launcher ends it
    raise SystemExit(f"rank {rank}: the write of step 2 was not killed")


def second_attempt(session: Session, folder: Path, out: Path) -> None:
    rank, events, model, optimizer, checkpointer = start(session, folder, out)
    torch.manual_seed(123)  # other random states: resume must restore the saved ones
    resumed = checkpointer.resume(model=model, optimizer=optimizer)
    assert resumed is not None
    found = {"step": resumed.step, "model": sh.local(model.state_dict()), "optimizer": sh.local(optimizer.state_dict())}
    found["draws"] = sh.random_draws()
    torch.save(found, out / f"resumed-rank{rank}.pt")
    last = resumed.step
    while last < resumed.step + 30:
        step(model, optimizer, rank)
        last += 1
        events.pause = last >= resumed.step + 2  # each rank's write, from the step the stop may come at
        checkpointer.save(step=last, model=model, optimizer=optimizer)
        if rank == 1 and last == resumed.step + 2:
            os.kill(os.getpid(), signal.SIGTERM)
        if session.should_stop:
            break
    if rank == 0:
        (out / "stopped.txt").write_text(f"{last}\n")
    # no wait() or close(): the session's end waits for the write (the group it needs closes there)


def main() -> None:
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    with Session(strategy="auto", timeout_s=60) as session:
        (first_attempt if restart_count() == 0 else second_attempt)(session, folder, out)


if __name__ == "__main__":
    main()
