"""A DDP run on the handwritten digits, for the demo: launch N processes, get weights and metrics back.

    result = run_ddp_digits(nproc_per_node=2, epochs=2)   # 2 gloo processes on CPU; one per GPU with "auto"
    result.accuracy, result.losses[-1], result.state_dict["0.weight"].shape

The processes run this file through ``multigpu launch --strategy ddp`` (so they exercise the real
launcher, torchrun and the session API); the main process writes the bare model's weights and its
metrics to a file that :func:`run_ddp_digits` reads back. The data (1,797 8x8 images, 10 classes)
ships inside scikit-learn.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from multigpu.errors import LaunchError
from multigpu.errors import ConfigError
from multigpu.session.session import Session


@dataclass(frozen=True)
class DigitsRunResult:
    """What a launched digits run returns (from its main process).

    Attributes:
        state_dict: the trained model's weights, bare keys (loads into :func:`build_digits_model`).
        losses: the training loss per step, averaged over processes.
        accuracy: the final accuracy on the whole dataset (each sample evaluated once).
        world_size: how many processes trained.
        strategy: the strategy the processes ran (``ddp``).
        ms_per_step: mean wall time of a training step in the main process.
        seconds: wall time of the whole launch (process start-up included).
    """

    state_dict: dict[str, torch.Tensor]
    losses: list[float]
    accuracy: float
    world_size: int
    strategy: str
    ms_per_step: float
    seconds: float


def digits_dataset() -> TensorDataset:
    """scikit-learn's digits as float inputs in [0, 1] and integer labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("the digits data ships with scikit-learn; install it: pip install 'multigpu[demo]'") from exc
    images, labels = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(images, dtype=torch.float32) / 16.0, torch.tensor(labels, dtype=torch.long))


def build_digits_model() -> nn.Module:
    """A small MLP for 8x8 digits."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def run_ddp_digits(
    *,
    nproc_per_node: int | str = "auto",
    epochs: int = 2,
    batch_size: int = 64,
    lr: float = 0.1,
    precision: str = "fp32",
    timeout_s: float = 300.0,
) -> DigitsRunResult:
    """Train on the digits with ``nproc_per_node`` DDP processes through ``multigpu launch``.

    Args:
        nproc_per_node: processes; ``"auto"`` is one per GPU, else 2 on CPU.
        epochs: passes over the data.
        batch_size: the global batch.
        lr: SGD learning rate.
        precision: ``fp32``, ``bf16`` or ``fp16``.
        timeout_s: the whole run is killed after this long.

    Returns:
        A :class:`DigitsRunResult`.

    Raises:
        LaunchError: the run failed or timed out (with the launcher's output).
    """
    with tempfile.TemporaryDirectory(prefix="multigpu-ddp-") as tmp:
        out = Path(tmp) / "result.pt"
        argv = [
            sys.executable, "-m", "multigpu", "launch", "--strategy", "ddp",
            "--nproc-per-node", str(nproc_per_node), __file__,
            "--out", str(out), "--epochs", str(epochs), "--batch-size", str(batch_size),
            "--lr", str(lr), "--precision", precision,
        ]  # fmt: skip
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise LaunchError(f"the DDP digits run took longer than timeout_s={timeout_s}; raise it") from exc
        seconds = time.perf_counter() - start
        if done.returncode != 0 or not out.exists():
            raise LaunchError(f"the DDP digits run failed (exit code {done.returncode}):\n{done.stderr[-4000:]}")
        saved: dict[str, Any] = torch.load(out)
    return DigitsRunResult(seconds=seconds, **saved)


def _train(args: argparse.Namespace) -> None:
    with Session(strategy="ddp", precision=args.precision) as session:
        model = session.setup_model(build_digits_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        dataset = digits_dataset()
        loader = session.build_loader(dataset, batch_size=args.batch_size)
        losses: list[float] = []
        step_seconds = 0.0
        for _ in range(args.epochs):
            for x, y in session.batches(loader):
                begin = time.perf_counter()
                with session.micro_step(model):
                    loss = F.cross_entropy(model(x), y)
                    session.backward(loss)
                session.step(optimizer)
                step_seconds += time.perf_counter() - begin
                losses.append(session.reduce(loss.detach()))
        predicted = session.evaluate(lambda batch: model(batch[0]).argmax(dim=1), dataset, batch_size=512)
        accuracy = float((predicted == dataset.tensors[1]).float().mean())
        if session.is_main_process:
            result = {
                "state_dict": session.unwrap(model).state_dict(),
                "losses": losses,
                "accuracy": accuracy,
                "world_size": session.world_size,
                "strategy": session.strategy_name,
                "ms_per_step": 1000.0 * step_seconds / max(1, len(losses)),
            }
            torch.save(result, args.out)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one process of the DDP digits run (started by run_ddp_digits)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--precision", default="fp32")
    return parser.parse_args(argv)


if __name__ == "__main__":
    _train(_parse(sys.argv[1:]))
