"""A DDP training run over gloo for the multi-process fault tests, started by ``multigpu launch``.

    multigpu launch --strategy ddp --nproc-per-node 2 \\
        tests/checkpoint/workers/ddp_worker.py --folder CKPT --events EVENTS --out final.safetensors \\
        --data digits.safetensors --steps 6 [--fault raise|hang|kill --fault-rank 1 --fault-step 3] [--timeout-s 3]

Every step saves a full checkpoint through multigpu's Checkpointer; a (re)started run resumes
from the latest one. ``--fault`` injects one failure: ``raise`` an exception, ``hang`` (stop
calling collectives), ``kill`` (SIGKILL itself, first attempt only, for --max-restarts), or
``disk-full`` (the file-size limit of the rank drops to 1 KiB before that step's save).
``--timeout-s`` is the timeout of the training collectives (DDP's process group). Each process records its pid, and the
faulty one the time of its failure, under EVENTS, so the test can time the teardown.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: `tests` imports

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

import multigpu.checkpoint as ckpt
from multigpu.runtime.collective_failures import explain_collective_failures
from tests.checkpoint import _training as tr


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folder", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--events", type=Path, required=True, help="folder for pid and timing records")
    parser.add_argument("--out", type=Path, required=True, help="final weights (safetensors)")
    parser.add_argument("--data", type=Path, required=True, help="the digits, as written by write_digits")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fault", choices=["none", "raise", "hang", "kill", "disk-full"], default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="timeout of the training collectives")
    return parser.parse_args()


def record_event(events: Path, name: str, payload: dict[str, Any]) -> None:
    (events / name).write_text(json.dumps({"time": time.time(), **payload}))


def forbid_writes_to(folder: Path) -> None:
    """Make any write, rename or delete under ``folder`` by this process an error (non-main ranks)."""
    root = str(folder.resolve())
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and len(args) == 3:
            path, mode, flags = args
            writing = bool(mode and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & write_flags)
        elif event in ("os.rename", "os.remove", "os.mkdir", "os.rmdir", "shutil.rmtree"):
            path, writing = args[0], True
        else:
            return
        if writing and isinstance(path, (str, os.PathLike)) and os.path.abspath(path).startswith(root):
            raise PermissionError(f"rank {dist.get_rank()} tried {event} on {path}: only rank 0 may write")

    sys.addaudithook(hook)


def maybe_fail(args: argparse.Namespace, rank: int, step: int, attempt: int) -> None:
    if args.fault == "none" or rank != args.fault_rank or step != args.fault_step:
        return
    if args.fault == "disk-full":
        # Writes past 1 KiB now fail as on a full disk (Python ignores SIGXFSZ: write gets EFBIG).
        record_event(args.events, "failed", {"rank": rank, "step": step, "fault": args.fault})
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return
    if args.fault == "kill" and attempt > 0:
        return
    record_event(args.events, "failed", {"rank": rank, "step": step, "fault": args.fault})
    if args.fault == "raise":
        raise RuntimeError(f"injected failure in rank {rank} at step {step}")
    if args.fault == "hang":
        time.sleep(600)  # stops calling collectives; the others must time out
    os.kill(os.getpid(), signal.SIGKILL)


@record
def main() -> None:
    args = parse()
    tr.DATA_FILE = args.data
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    record_event(args.events, f"pid-{attempt}-{rank}", {"pid": os.getpid()})
    if rank != 0:
        forbid_writes_to(args.folder)
    model = tr.build_model()  # the same initial weights on every rank
    tr.seed_everything(100 + rank)  # each rank its own dropout and noise streams
    # The training collectives get their own group with the short --timeout-s; start-up and
    # checkpoint collectives keep the default group's generous timeout (start-up skew on a
    # loaded machine is not a hang).
    training_group = dist.new_group(timeout=datetime.timedelta(seconds=args.timeout_s))
    parts = tr.build_parts(DistributedDataParallel(model, process_group=training_group))
    checkpointer = ckpt.Checkpointer(folder=args.folder, keep_last=2)
    resumed = checkpointer.resume(
        model=parts.model, optimizer=parts.optimizer, scheduler=parts.scheduler, scaler=parts.scaler
    )
    start = resumed.step if resumed else 0
    record_event(args.events, f"start-{attempt}-{rank}", {"resumed_from": start})
    for step in range(start, args.steps):
        maybe_fail(args, rank, step, attempt)
        with explain_collective_failures(f"training step {step}"):
            tr.train_step(parts, step, rank=rank, world_size=world)
        epoch, batch = divmod(step + 1, tr.BATCHES_PER_EPOCH)
        saved = checkpointer.save(
            step=step + 1,
            model=parts.model,
            optimizer=parts.optimizer,
            scheduler=parts.scheduler,
            scaler=parts.scaler,
            epoch=epoch,
            data_position={"batch": batch},
        )
        # Every rank returns from save only once rank 0 has finished writing.
        if checkpointer.latest() != saved:
            raise RuntimeError(f"rank {rank}: save returned before {saved} was complete")
    ckpt.save(parts.model, args.out)
    del parts  # release DDP's reducer before the group goes (an abort at exit otherwise: pytorch#190489)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
