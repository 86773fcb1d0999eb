"""A small Session training script for `multigpu advise --measure --script` (tests/planning/test_measure_cli.py).

python tests/planning/_session_script.py [--steps N] [--batch B]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from multigpu import Session


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    data = torch.utils.data.TensorDataset(
        torch.randn(args.steps * args.batch, 16), torch.randint(0, 4, (args.steps * args.batch,))
    )
    with Session(strategy="auto") as session:
        model = session.setup_model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in session.batches(session.build_loader(data, batch_size=args.batch, shuffle=False)):
            with session.micro_step(model):
                session.backward(nn.functional.cross_entropy(model(x), y))
            session.step(optimizer)


if __name__ == "__main__":
    main()
