"""The transformers loop of examples/train_gpt.py through the Session and through Accelerate: losses and step time.

    python benchmarks/accelerate_gpt.py                     # 2 gloo ranks each, 8 optimizer steps, bf16
    python benchmarks/accelerate_gpt.py --steps 12 --precision fp32 --rounds 2

Both loops train the same tiny GPT-2 (built from a config) on the same padded ragged sequences,
same seed, same global batch (``--batch`` sequences per rank and micro-step, ``--accumulate``
micro-steps per optimizer step), a token-summed causal-LM loss normalised by the tokens of the
whole window on every rank, AdamW and clipping at 1.0, no shuffling (both loaders then give the
same global micro-batches). Both run under ``multigpu launch --strategy ddp --nproc-per-node 2``
(the same torchrun environment; ``Accelerator(cpu=True)`` reads it).

- Session: ``session.backward(loss_sum, num_items=tokens)``; one all-reduce of [loss sum, tokens]
  at the step gives the gradient's factor and ``session.window_loss``.
- Accelerate (its documented recipe for token-weighted losses): fetch the window's micro-batches
  first, ``accelerator.gather`` their token counts, then ``accelerator.backward(loss_sum *
  num_processes * accumulate / tokens)`` inside ``accelerator.accumulate(model)``; the logged
  loss is ``accelerator.reduce`` of the summed losses over the tokens.

Prints the largest per-step loss difference and the median optimizer-step time of each, and their
ratio (target: the same losses, Session <= 1.0x Accelerate). Needs ``pip install -e '.[bench,dev]'``.
This file is also the worker (``--worker session|accelerate``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from train_gpt import IGNORE, CountingSequences, build_model, pad_batch, token_loss  # noqa: E402

from multigpu.session import Session  # noqa: E402

NPROC = 2


def worker_session(args: argparse.Namespace) -> dict[str, Any]:
    with Session(strategy="ddp", precision=args.precision, accumulate=args.accumulate) as session:
        model = session.setup_model(build_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = CountingSequences(NPROC * args.batch * args.accumulate * args.steps, seed=1)
        loader = session.setup_dataloader(
            DataLoader(data, batch_size=NPROC * args.batch, shuffle=False, collate_fn=pad_batch)
        )
        losses, ends = [], [time.perf_counter()]
        for batch in session.batches(loader):
            with session.micro_step(model):
                loss, tokens = token_loss(model, batch)
                session.backward(loss, num_items=tokens)
            if session.should_step:
                session.step(optimizer, max_grad_norm=1.0)
                losses.append(session.window_loss)
                ends.append(time.perf_counter())
        return {"rank": session.global_rank, "losses": losses, "ends": ends, "threads": torch.get_num_threads()}


def worker_accelerate(args: argparse.Namespace) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    precision = "no" if args.precision == "fp32" else args.precision
    # sync_with_dataloader=False: the window is fetched before its micro-steps, so the loader's end
    # is seen at the last window's first micro-step, where Accelerate would otherwise step early
    plugin = GradientAccumulationPlugin(num_steps=args.accumulate, sync_with_dataloader=False)
    accelerator = Accelerator(cpu=True, mixed_precision=precision, gradient_accumulation_plugin=plugin)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = CountingSequences(NPROC * args.batch * args.accumulate * args.steps, seed=1)
    loader = DataLoader(data, batch_size=args.batch, shuffle=False, collate_fn=pad_batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)
    losses, ends = [], [time.perf_counter()]
    for _ in range(args.steps):
        window = [next(batches) for _ in range(args.accumulate)]
        mine = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in window)
        total = accelerator.gather(torch.tensor([mine])).sum()
        summed = torch.zeros(())
        for batch in window:
            with accelerator.accumulate(model):
                loss, _ = token_loss(model, batch)
                # backward divides by gradient_accumulation_steps and DDP averages over processes
                accelerator.backward(loss * accelerator.num_processes * args.accumulate / total)
                summed += loss.detach().float()
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        losses.append(float(accelerator.reduce(summed, "sum") / total))
        ends.append(time.perf_counter())
    result = {"rank": accelerator.process_index, "losses": losses, "ends": ends, "threads": torch.get_num_threads()}
    if result["rank"] == 0:  # before the teardown: a rank leaving first once left rank 0 waiting in it
        Path(args.out).write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {**result, "rank": -1}  # written


def run(loop: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "multigpu", "launch", "--strategy", "ddp", "--nproc-per-node", str(NPROC)]
    argv += [__file__, "--worker", loop, "--out", str(out)]
    argv += ["--steps", str(args.steps), "--batch", str(args.batch), "--accumulate", str(args.accumulate)]
    argv += ["--precision", args.precision]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{loop} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and micro-step")
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of the two loops")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps left out of the timing")
    parser.add_argument("--worker", choices=["session", "accelerate"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = (worker_session if args.worker == "session" else worker_accelerate)(args)
        if result["rank"] == 0:
            Path(args.out).write_text(json.dumps(result))
        return
    folder = Path(subprocess.run(["mktemp", "-d"], capture_output=True, text=True).stdout.strip())
    results: dict[str, list[dict[str, Any]]] = {"session": [], "accelerate": []}
    for round_ in range(args.rounds):
        for loop in ("session", "accelerate") if round_ % 2 == 0 else ("accelerate", "session"):
            results[loop].append(run(loop, args, folder / f"{loop}{round_}.json"))
    steps = {
        loop: [b - a for r in rs for a, b in list(zip(r["ends"], r["ends"][1:]))[args.warmup :]]
        for loop, rs in results.items()
    }
    session_loss, accelerate_loss = results["session"][0]["losses"], results["accelerate"][0]["losses"]
    difference = max(abs(a - b) for a, b in zip(session_loss, accelerate_loss))
    session_s, accelerate_s = statistics.median(steps["session"]), statistics.median(steps["accelerate"])
    print(
        f"{args.steps} steps x {args.accumulate} micro-steps x {NPROC} ranks x {args.batch} sequences, {args.precision}"
    )
    print("| loop | first loss | last loss | step (median) |")
    print("|---|---|---|---|")
    for loop, losses, seconds in (("Session", session_loss, session_s), ("Accelerate", accelerate_loss, accelerate_s)):
        print(f"| {loop} | {losses[0]:.6f} | {losses[-1]:.6f} | {seconds * 1e3:.1f} ms |")
    threads = {loop: sorted({r["threads"] for r in rs}) for loop, rs in results.items()}
    print(f"intra-op threads per process: Session {threads['session']}, Accelerate {threads['accelerate']}")
    print(
        f"largest per-step loss difference {difference:.2e}; step time Session / Accelerate {session_s / accelerate_s:.2f}x"
    )


if __name__ == "__main__":
    main()
