"""A 2-process fsdp run for the sharded-checkpoint tests (tests/checkpoint/test_sharded_multiprocess.py).

    multigpu launch --strategy fsdp --nproc-per-node 2 tests/checkpoint/workers/fsdp_worker.py \\
        --folder CKPT --out OUT --data digits.safetensors --phase interrupt --steps 3 \\
        --kill-rank 1 --kill-fraction 0.4
    multigpu launch ... --phase resume --steps 6

``interrupt``: train ``--steps`` steps, saving a checkpoint after each (rank 0 also records the
whole weights then, OUT/weights-N.safetensors), then train one more step and save it, during which
rank ``--kill-rank`` SIGKILLs itself at its n-th file-system event inside the checkpoint folder
(an open, rename, mkdir, remove, ...), n = fraction x the events of its first save. It writes
which event it was to OUT/killed-rank<R>.txt first.

``resume``: resume from the folder at world size 2, train to ``--steps`` saving each step; record
the whole weights (OUT/resumed.safetensors), this rank's optimizer slices and one draw of every
random generator (OUT/resumed-rank<R>.pt); then train a fresh model ``--steps`` steps straight
from the same start without checkpoints and record the same (straight*). Last, rank 0 copies the
latest checkpoint to OUT/damaged and flips one byte of rank 0's shard, and both ranks try to
resume from it (OUT/damaged-rank<R>.txt: the error each got).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: `tests` imports

import torch
import torch.distributed as dist

import multigpu
import multigpu.checkpoint as ckpt
from multigpu.errors import CheckpointError
from multigpu.session import Session
from tests.checkpoint import _sharded as sh
from tests.checkpoint import _training as tr

_EVENTS = {"open", "os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "os.listdir", "os.scandir"}


class KillSwitch:
    """Counts this process's file-system events inside one folder; SIGKILLs the process at the n-th when armed."""

    def __init__(self, folder: Path, report: Path) -> None:
        self.root = str(folder.resolve())
        self.report = report
        self.count = 0
        self.kill_at: int | None = None
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event not in _EVENTS or not args or not isinstance(args[0], (str, os.PathLike)):
            return
        path = os.path.abspath(os.fspath(args[0]))
        if not path.startswith(self.root):
            return
        self.count += 1
        if self.kill_at is not None and self.count >= self.kill_at:
            self.kill_at = None
            with open(self.report, "w") as f:  # outside the folder: not an event of ours
                f.write(f"{self.count} {event} {path}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--phase", choices=["interrupt", "resume"], required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-fraction", type=float, default=0.5)
    return parser.parse_args()


def start(session: Session) -> sh.Run:
    run = sh.build_run(session.setup_model(tr.build_model()))  # the same initial weights on every rank
    tr.seed_everything(100 + session.global_rank)  # each rank its own dropout and noise streams
    return run


def save(checkpointer: ckpt.Checkpointer, run: sh.Run, step: int) -> None:
    checkpointer.save(step=step, model=run.model, optimizer=run.optimizer, scheduler=run.scheduler)


def interrupt(session: Session, args: argparse.Namespace) -> None:
    rank, world = session.global_rank, session.world_size
    switch = KillSwitch(args.folder, args.out / f"killed-rank{rank}.txt")
    checkpointer = ckpt.Checkpointer(folder=args.folder, keep_last=2)
    run = start(session)
    first_save = 0
    for step in range(args.steps):
        sh.train_step(run, step, rank=rank, world_size=world)
        before = switch.count
        save(checkpointer, run, step + 1)
        first_save = first_save or switch.count - before
        multigpu.save(run.model, args.out / f"weights-{step + 1}.safetensors")  # every rank: gathered
    sh.train_step(run, args.steps, rank=rank, world_size=world)
    if rank == args.kill_rank:
        switch.kill_at = switch.count + max(1, round(args.kill_fraction * first_save))
    save(checkpointer, run, args.steps + 1)
    raise SystemExit(f"rank {rank} was not killed during the save (its first save made {first_save} events)")


def record(run: sh.Run, rank: int, out: Path, name: str) -> None:
    multigpu.save(run.model, out / f"{name}.safetensors")  # every rank: gathered, rank 0 writes
    torch.save(
        {"optimizer": sh.local(run.optimizer.state_dict()), "draws": sh.random_draws()}, out / f"{name}-rank{rank}.pt"
    )


def resume(session: Session, args: argparse.Namespace) -> None:
    rank, world = session.global_rank, session.world_size
    checkpointer = ckpt.Checkpointer(folder=args.folder, keep_last=2)
    run = sh.build_run(session.setup_model(tr.build_model()))
    tr.seed_everything(7 + rank)  # other random states than the interrupted run's: resume must restore them
    resumed = checkpointer.resume(model=run.model, optimizer=run.optimizer, scheduler=run.scheduler)
    assert resumed is not None
    (args.out / f"resumed-from-rank{rank}.txt").write_text(f"{resumed.step} {resumed.saved_world_size}")
    for step in range(resumed.step, args.steps):
        sh.train_step(run, step, rank=rank, world_size=world)
        save(checkpointer, run, step + 1)
    record(run, rank, args.out, "resumed")

    straight = start(session)
    for step in range(args.steps):
        sh.train_step(straight, step, rank=rank, world_size=world)
    record(straight, rank, args.out, "straight")

    damaged = args.out / "damaged"
    if rank == 0:
        latest = checkpointer.latest()
        assert latest is not None
        shutil.copytree(latest, damaged / latest.name)
        # The files' CRC-32s are split over the ranks in name order (.metadata, __0_0, __1_0): rank 1
        # checks __0_0.distcp, so rank 0's own checks pass and only the ranks' agreement stops it.
        shard = damaged / latest.name / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()
    began = time.monotonic()
    try:
        ckpt.Checkpointer(folder=damaged).resume(model=run.model, optimizer=run.optimizer)
        outcome = "resumed"
    except CheckpointError as exc:
        outcome = f"CheckpointError: {exc}"
    (args.out / f"damaged-rank{rank}.txt").write_text(f"{time.monotonic() - began:.2f}\n{outcome}")


def main() -> None:
    args = parse()
    tr.DATA_FILE = args.data
    with Session(strategy="auto", timeout_s=60) as session:
        (interrupt if args.phase == "interrupt" else resume)(session, args)


if __name__ == "__main__":
    main()
