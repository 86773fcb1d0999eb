"""Blocking time of an asynchronous checkpoint save against a blocking one, ~100 MB model, one run.

    .venv/bin/python benchmarks/async_save.py               # 7 repeats, folders in a temp folder
    .venv/bin/python benchmarks/async_save.py --repeats 11 --megabytes 100 --optimizer adam --dir /data/tmp
    .venv/bin/python -m multigpu launch --strategy fsdp --nproc-per-node 2 benchmarks/async_save.py --fsdp

Each repeat, in alternating order, times ``Checkpointer.save`` with ``async_save=False`` (the whole
write: safetensors, checksums, fsync, rename) and with ``async_save=True`` (the copy into the
reused staging buffers; the previous write was waited for outside the timer, as when a training
step outlasts a write), then the background write itself (``wait()`` right after). The table shows
medians; the ratio async/sync of the blocking times is the figure of issue 31 (target <= 0.25, aim
0.15). The first asynchronous save, which allocates the buffers, is shown apart.

``--fsdp`` (under ``multigpu launch --strategy fsdp``): the model is sharded and every rank saves its
shards into a folder of rank 0's; each save starts after a barrier and its time is the slowest rank's
(the training step's next collective waits for that rank). Rank 0 prints.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import multigpu.checkpoint as ckpt

TARGET, AIM = 0.25, 0.15


def build_model(megabytes: float) -> nn.Module:
    width = 2560
    layers = max(1, round(megabytes * 2**20 / (4 * (width * width + width))))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def build_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer | None:
    if kind == "none":
        return None
    optimizer: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters())
        if kind == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # its state exists, as in training
    return optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--megabytes", type=float, default=100.0)
    parser.add_argument("--optimizer", choices=["none", "sgd", "adam"], default="none")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoint folders go (a temp folder)")
    parser.add_argument("--fsdp", action="store_true", help="sharded, under multigpu launch --strategy fsdp")
    args = parser.parse_args()
    if not args.fsdp:
        measure(args, None)
        return
    from multigpu.session import Session

    with Session(strategy="auto") as session:
        measure(args, session)


def slowest(seconds: float) -> float:
    """The longest of every rank's ``seconds`` (itself outside a process group)."""
    if not dist.is_initialized():
        return seconds
    value = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def together() -> None:
    if dist.is_initialized():
        dist.barrier()


def measure(args: argparse.Namespace, session: Any) -> None:
    torch.manual_seed(0)
    model = build_model(args.megabytes)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
    if session is not None:
        model = session.setup_model(model)
    optimizer = build_optimizer(model, args.optimizer)
    made = [
        tempfile.mkdtemp(prefix="async-save-", dir=args.dir)
        if not dist.is_initialized() or dist.get_rank() == 0
        else ""
    ]
    if dist.is_initialized():
        dist.broadcast_object_list(made, src=0)  # every rank writes into rank 0's folder
    root = Path(made[0])
    try:
        blocking = ckpt.Checkpointer(folder=root / "sync", keep_last=2)
        background = ckpt.Checkpointer(folder=root / "async", keep_last=2, async_save=True)
        together()
        start = time.perf_counter()
        background.save(step=0, model=model, optimizer=optimizer)
        first = slowest(time.perf_counter() - start)
        background.wait()
        times: dict[str, list[float]] = {"sync": [], "async": [], "write": []}
        for repeat in range(1, args.repeats + 1):
            for kind in ("sync", "async") if repeat % 2 else ("async", "sync"):
                together()
                if kind == "sync":
                    start = time.perf_counter()
                    blocking.save(step=repeat, model=model, optimizer=optimizer)
                    times["sync"].append(slowest(time.perf_counter() - start))
                else:
                    start = time.perf_counter()
                    background.save(step=repeat, model=model, optimizer=optimizer)
                    returned = time.perf_counter()
                    background.wait()
                    written = time.perf_counter()
                    times["async"].append(slowest(returned - start))
                    times["write"].append(slowest(written - returned))
        background.close()
    finally:
        together()
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    if dist.is_initialized() and dist.get_rank() != 0:
        return

    median = {k: statistics.median(v) for k, v in times.items()}
    ratio = median["async"] / median["sync"]
    ranks = f", fsdp over {dist.get_world_size()} ranks" if dist.is_initialized() else ""
    print(f"model {size:.1f} MB{ranks}, optimizer {args.optimizer}, {args.repeats} repeats, torch {torch.__version__}")
    print(f"blocking save (async_save=False)        median {median['sync'] * 1e3:8.1f} ms")
    print(f"async save, returns after the copy      median {median['async'] * 1e3:8.1f} ms")
    print(f"  its write in the background           median {median['write'] * 1e3:8.1f} ms")
    print(f"  first async save (allocates buffers)         {first * 1e3:8.1f} ms")
    verdict = "aim met" if ratio <= AIM else ("target met" if ratio <= TARGET else "target MISSED")
    print(f"blocking time async/sync: {ratio:.3f} (target <= {TARGET}, aim {AIM}): {verdict}")


if __name__ == "__main__":
    main()
