"""Save checkpoints in a loop until killed, printing ``saved <n>`` after each save returns.

python save_forever.py MODE FOLDER [--writer ID] [--fallback] [--saves N] [--width W]

MODE:
  weights     multigpu.save of one file, value 1, 2, 3, ... (continues after the value found)
  steps       Checkpointer.save of steps N+1, N+2, ... (N = the latest step found), value = step
  resave      Checkpointer.save of step 5 again and again, value 1, 2, 3, ... (continues)
  concurrent  Checkpointer.save of steps 1, 2, 3, ..., value = ID * 1_000_000 + step

Every checkpoint's weights are filled with its value and ``extra={"value": value}`` repeats it, so a
reader can tell whether a model file and a state file belong together. ``--fallback`` turns off
renameat2(RENAME_EXCHANGE) so re-saves use the aside-folder path; ``--saves N`` exits after N
saves instead of running until killed.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
from torch import nn

import multigpu.checkpoint as ckpt

try:
    from multigpu.checkpoint import atomic
except ImportError:  # a version without it (to run these kill tests against older code)
    atomic = None  # type: ignore[assignment]

WIDTH = 1024  # 4 MiB of weights: a save takes long enough for kills to land inside it


def build(value: float, width: int = WIDTH) -> nn.Module:
    model = nn.Linear(width, width)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def current_value(mode: str, folder: Path, width: int) -> int:
    model = nn.Linear(width, width)
    if mode == "weights":
        with contextlib.suppress(Exception):
            ckpt.load(model, folder / "model.safetensors")
            return int(model.weight[0, 0])
        return 0
    resumed = ckpt.Checkpointer(folder=folder).resume(model=model)
    return 0 if resumed is None else int(resumed.step if mode == "steps" else resumed.extra["value"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["weights", "steps", "resave", "concurrent"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--writer", type=int, default=0)
    parser.add_argument("--fallback", action="store_true")
    parser.add_argument("--saves", type=int, default=0)
    parser.add_argument("--width", type=int, default=WIDTH)
    # start counting at 0 instead of resuming: a writer started beside another one that is already
    # re-saving the same step in a tight loop may find it changing at every read (resume refuses then)
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()
    if atomic is not None:
        atomic.use_exchange = not args.fallback
    checkpointer = ckpt.Checkpointer(folder=args.folder, keep_last=2)
    n = 0 if args.mode == "concurrent" or args.fresh else current_value(args.mode, args.folder, args.width)
    for _ in iter(int, 1) if args.saves <= 0 else range(args.saves):  # forever, or N times
        n += 1
        value = args.writer * 1_000_000 + n if args.mode == "concurrent" else n
        model = build(float(value), args.width)
        if args.mode == "weights":
            ckpt.save(model, args.folder / "model.safetensors")
        else:
            step = 5 if args.mode == "resave" else n
            checkpointer.save(step=step, model=model, extra={"value": value})
        print(f"saved {value}", flush=True)


if __name__ == "__main__":
    main()
