"""Asynchronous saves in a process of their own (the test kills it, limits its file size, or lets it exit).

python async_saves.py {size-limit|killed|exit} FOLDER [LIMIT_BYTES]
multigpu launch --strategy ddp --nproc-per-node 2 async_saves.py ddp-failure FOLDER

``size-limit``: step 1 is written whole, then the file size is limited (SIGXFSZ ignored) and each
background write of step 2 fails; prints ``<where>: <message>`` for the call that raised it (wait,
the next save, close). ``killed``: step 1 whole, then the background write of a 64 MiB step 2, while
the caller goes on (the test kills it mid-write). ``exit``: saves step 1 and leaves at once, without
wait (the interpreter must wait for the write). ``ddp-failure``: rank 0's file size is limited before
step 2; every rank prints ``rank R wait: <message>``; then
step 4 is saved (rank 0's write slowed) and resumed at once: ``rank R resumed: <step> <a weight>``.
"""

from __future__ import annotations

import resource
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.errors import CheckpointError


def filled(width: int, value: float) -> nn.Linear:
    model = nn.Linear(width, width)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return model


def limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def size_limit(folder: Path, limit: int) -> None:
    checkpointer = ckpt.Checkpointer(folder=folder, keep_last=2, async_save=True)
    checkpointer.save(step=1, model=filled(512, 1.0))  # 1 MiB
    checkpointer.wait()
    limit_file_size(limit)
    big = filled(2048, 2.0)  # 16 MiB
    for where, after in (
        ("wait", checkpointer.wait),
        ("save", lambda: checkpointer.save(step=3, model=big)),
        ("close", checkpointer.close),
    ):
        checkpointer.save(step=2, model=big)
        print("returned", flush=True)
        try:
            after()
            print(f"{where}: no error", flush=True)
        except CheckpointError as exc:
            print(f"{where}: {exc}", flush=True)


def killed(folder: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=folder, keep_last=2, async_save=True)
    model = filled(4096, 1.0)  # 64 MiB
    checkpointer.save(step=1, model=model)
    checkpointer.wait()
    print("saved 1", flush=True)
    with torch.no_grad():
        model.weight.fill_(2.0)
    checkpointer.save(step=2, model=model)
    print("returned 2", flush=True)
    with torch.no_grad():
        model.weight.fill_(3.0)  # the caller goes on while the write runs
    time.sleep(60)


def leave_at_once(folder: Path) -> None:
    checkpointer = ckpt.Checkpointer(folder=folder, async_save=True)
    model = filled(2048, 1.0)
    checkpointer.save(step=1, model=model)
    with torch.no_grad():
        model.weight.fill_(5.0)
    print("returned", flush=True)


def ddp_failure(folder: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checkpointer = ckpt.Checkpointer(folder=folder, keep_last=2, async_save=True)
    checkpointer.save(step=1, model=filled(512, 1.0))
    checkpointer.wait()
    if rank == 0:
        limit_file_size(64 << 10)
    checkpointer.save(step=2, model=filled(512, 2.0))
    try:
        checkpointer.wait()
        print(f"rank {rank} wait: no error", flush=True)
    except CheckpointError as exc:
        print(f"rank {rank} wait: {exc}", flush=True)
    checkpointer.save(step=3, model=filled(64, 3.0))  # the ranks go on together afterwards
    # resume waits for the pending write on every rank, not only on rank 0 (whose write is slowed here)
    root = str(folder.resolve())

    def slow_rename(event: str, args: tuple[object, ...]) -> None:
        if event == "os.rename" and args and str(args[0]).startswith(root):
            time.sleep(0.5)

    sys.addaudithook(slow_rename)
    checkpointer.save(step=4, model=filled(64, 4.0))
    into = filled(64, 0.0)
    resumed = checkpointer.resume(model=into)
    print(f"rank {rank} resumed: {resumed.step if resumed else None} {into.weight.detach()[0, 0].item()}", flush=True)
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, where = sys.argv[1], Path(sys.argv[2])
    if mode == "size-limit":
        size_limit(where, int(sys.argv[3]))
    elif mode == "killed":
        killed(where)
    elif mode == "exit":
        leave_at_once(where)
    else:
        ddp_failure(where)
