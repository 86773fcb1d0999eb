"""The demo's figures: loss curves of every run (PNG)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from multigpu.demo.train import RunResult  # noqa: E402


def plot_losses(runs: Sequence[RunResult], path: Path) -> Path:
    """Training loss per step for every run, overlaid; returns the written path."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        ax.plot(run.losses, styles[i % len(styles)], linewidth=1.6, label=run.name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_yscale("log")
    ax.set_title("Digits CNN: identical curves mean identical training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
