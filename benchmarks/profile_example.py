"""A small real training script to try the profiler on: a CNN on scikit-learn's digits.

    multigpu profile --out profile-out benchmarks/profile_example.py --devices cpu:2
    python benchmarks/profile_example.py --devices cpu:2        # or just train, unprofiled

The script knows nothing about profiling: ``multigpu profile`` stops it after a few steps.
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import multigpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="cpu:2")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    devices = multigpu.parse_devices(args.devices)
    net.to(devices[0].device)
    model = multigpu.DataParallel(net, devices=args.devices)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for epoch in range(args.epochs):
        order = torch.randperm(len(labels))
        for start in range(0, len(labels), args.batch):
            index = order[start : start + args.batch]
            x, y = images[index].to(devices[0].device), labels[index].to(devices[0].device)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        print(f"epoch {epoch}: loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
