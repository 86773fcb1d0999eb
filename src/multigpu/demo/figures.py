"""The demo's figures: loss curves of every run and per-device peak memory (PNG)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from multigpu.demo.train import RunResult
from multigpu.report.figures import pyplot, save_figure


def plot_losses(runs: Sequence[RunResult], path: Path) -> Path:
    """Training loss per step for every run, overlaid; returns the written path."""
    fig, ax = pyplot().subplots(figsize=(7, 4), dpi=120)
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        ax.plot(run.losses, styles[i % len(styles)], linewidth=1.6, label=run.name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_yscale("log")
    ax.set_title("Digits CNN: identical curves mean identical training")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def plot_memory(runs: Sequence[RunResult], path: Path) -> Path:
    """Peak memory per device of one training step, one group of bars per device, one bar per run."""
    runs = [r for r in runs if len(r.memory) > 1]
    labels = [m.label for m in runs[0].memory]
    width = 0.8 / len(runs)
    fig, ax = pyplot().subplots(figsize=(7, 4), dpi=120)
    for i, run in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [m.peak / 2**20 for m in run.memory], width, label=run.name)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("device (the first is the primary)")
    ax.set_ylabel("peak memory in one step (MiB)")
    ax.set_title("Per-device peak memory: standard vs balanced DataParallel")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return save_figure(fig, path)
