"""The demo's data: scikit-learn's handwritten digits (1,797 8x8 images, 10 classes, no download)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Digits:
    """Train and test tensors: images shaped (N, 1, 8, 8) scaled to [0, 1], integer labels."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    def to(self, device: str | torch.device) -> Digits:
        """The same data on ``device``."""
        return Digits(*(t.to(device) for t in (self.train_x, self.train_y, self.test_x, self.test_y)))


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Digits:
    """Load the digits and split them with a fixed permutation (the same split on every rank)."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as exc:  # the demo extra brings it
        raise ImportError("the demo's data comes from scikit-learn: pip install 'multigpu[demo]'") from exc
    bunch = sklearn_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Digits(images[train], labels[train], images[test], labels[test])
