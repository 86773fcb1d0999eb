"""Train a small classifier on handwritten digits; the same script under every strategy.

    python examples/train.py                                              # auto: one device here
    multigpu launch --strategy single examples/train.py
    multigpu launch --strategy dp --devices cpu:2 examples/train.py       # threads, one process
    multigpu launch --strategy ddp --nproc-per-node 2 examples/train.py   # processes, gloo on CPU
    multigpu launch --strategy fsdp --nproc-per-node 2 examples/train.py  # processes, model sharded

Options: --precision fp32|bf16|fp16, --accumulate N (gradient accumulation), --epochs,
--batch-size (the global batch, whatever the strategy), --save out.pt (final weights and the
losses, written by the main process). The data (1,797 8x8 images) ships inside scikit-learn.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from multigpu.checkpoint.weights import full_state_dict
from multigpu.session import Session


def digits_dataset() -> TensorDataset:
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0  # pixel values are 0..16
    return TensorDataset(x, torch.tensor(labels, dtype=torch.long))


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--strategy", default="auto", help="single, dp, ddp, fsdp or auto (what multigpu launch asked for)"
    )
    parser.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch over all devices")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many batches per epoch (0: all)")
    parser.add_argument("--save", default="", help="write final weights and losses here (main process)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with Session(strategy=args.strategy, precision=args.precision, accumulate=args.accumulate) as session:
        model = session.setup_model(build_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        dataset = digits_dataset()
        loader = session.build_loader(dataset, batch_size=args.batch_size)
        losses: list[float] = []
        for epoch in range(args.epochs):
            for step, (x, y) in enumerate(session.batches(loader)):
                if args.max_steps and step >= args.max_steps:
                    break
                with session.micro_step(model):
                    loss = F.cross_entropy(model(x), y)
                    session.backward(loss)
                session.step(optimizer)
                losses.append(session.reduce(loss.detach()))  # mean over processes
            predicted = session.evaluate(lambda batch: model(batch[0]).argmax(dim=1), dataset, batch_size=256)
            accuracy = (predicted == dataset.tensors[1]).float().mean().item()
            session.print(
                f"[{session.strategy_name} x{session.replicas}] epoch {epoch}: "
                f"loss {losses[-1]:.4f}, accuracy {accuracy:.3f} on {len(predicted)} samples"
            )
        # Every rank: under fsdp the weights are gathered from the shards (a collective); else a no-op.
        weights = full_state_dict(session.unwrap(model))
        if args.save and session.is_main_process:
            torch.save({"state_dict": dict(weights), "losses": losses, "accuracy": accuracy}, args.save)


if __name__ == "__main__":
    main()
