"""The demo's DDP run: the same CNN, split, seed, data order and global batch as the other runs,
in N processes started through ``multigpu launch --strategy ddp``.

    result = run_ddp(TrainConfig(epochs=2), nproc_per_node=2)   # 2 gloo processes on CPU

Every process draws the same permutation; each global batch is cut into one contiguous chunk
per rank (as DataParallel cuts it across replicas), and each rank's loss is its chunk's summed
cross-entropy times ``world_size / global_batch``, so that DDP's gradient average equals the
gradient of the mean loss over the whole global batch, even when it does not divide evenly.
Rank 0 writes its results to a file that :func:`run_ddp` reads back.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from multigpu.demo.data import load_digits
from multigpu.demo.model import build_cnn
from multigpu.demo.train import RunResult, TrainConfig
from multigpu.errors import LaunchError
from multigpu.session import Session

_GRACE_S = 5  # seconds the workers get to exit once the demo stops its launch


def run_ddp(config: TrainConfig, *, nproc_per_node: int | str = "auto", timeout_s: float = 300.0) -> RunResult:
    """Train the demo CNN with DDP in ``nproc_per_node`` processes (``"auto"``: one per GPU, else 2).

    Raises:
        LaunchError: the run failed or ran past ``timeout_s`` (with the launcher's output).
    """
    with tempfile.TemporaryDirectory(prefix="multigpu-demo-ddp-") as tmp:
        out = Path(tmp) / "result.pt"
        argv = [
            sys.executable,
            "-m",
            "multigpu",
            "launch",
            "--strategy",
            "ddp",
            "--nproc-per-node",
            str(nproc_per_node),
            __file__,
            "--out",
            str(out),
            "--epochs",
            str(config.epochs),
            "--batch-size",
            str(config.batch_size),
            "--lr",
            str(config.lr),
            "--seed",
            str(config.seed),
            "--dtype",
            config.dtype,
            "--warmup-steps",
            str(config.warmup_steps),
        ]
        argv[argv.index("--nproc-per-node") : argv.index("--nproc-per-node")] = ["--grace-period", str(_GRACE_S)]
        launcher = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            _, err = launcher.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            _stop(launcher)
            raise LaunchError(f"the demo's DDP run took longer than timeout_s={timeout_s}; raise it") from exc
        finally:
            if launcher.poll() is None:  # an error here (Ctrl-C): the run must not outlive the demo
                _stop(launcher)
        if launcher.returncode != 0 or not out.exists():
            raise LaunchError(f"the demo's DDP run failed (exit code {launcher.returncode}):\n{err[-4000:]}")
        saved = torch.load(out)
    world_size = saved["world_size"]
    result = RunResult(f"DDP, {world_size} process{'' if world_size == 1 else 'es'}")  # one on a 1-GPU machine
    result.losses, result.accuracy = saved["losses"], saved["accuracy"]
    result.samples_per_s, result.state = saved["samples_per_s"], saved["state"]
    result.first_state = saved["first_state"]
    return result


def _stop(launcher: subprocess.Popen[str]) -> None:
    """End the launch and its workers: SIGTERM to the launcher, whose agent stops the workers (each in a
    session of its own, which a signal to the launcher's group does not reach) within the grace period;
    SIGKILL to its group after that."""
    for signum, wait_s in ((signal.SIGTERM, _GRACE_S + 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(launcher.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            launcher.communicate(timeout=wait_s)
            return


def _train(args: argparse.Namespace) -> None:
    with Session(strategy="ddp", seed=args.seed) as session:
        dtype = TrainConfig(dtype=args.dtype).torch_dtype
        data = load_digits(seed=args.seed).to(session.device)
        train_x, test_x = data.train_x.to(dtype), data.test_x.to(dtype)
        torch.manual_seed(args.seed)
        bare = build_cnn().to(dtype)
        model = session.setup_model(bare)
        optimizer = torch.optim.SGD(bare.parameters(), lr=args.lr, momentum=0.9)
        order = torch.Generator().manual_seed(args.seed)
        losses: list[float] = []
        first_state: dict[str, torch.Tensor] = {}
        samples, elapsed = 0, 0.0
        for _ in range(args.epochs):
            perm = torch.randperm(len(data.train_y), generator=order)
            for start in range(0, len(perm), args.batch_size):
                idx = perm[start : start + args.batch_size]
                mine = idx.tensor_split(session.world_size)[session.global_rank]
                began = time.perf_counter()
                with session.micro_step(model):
                    summed = nn.functional.cross_entropy(model(train_x[mine]), data.train_y[mine], reduction="sum")
                    loss = summed * session.world_size / len(idx)
                    session.backward(loss)
                session.step(optimizer)
                if len(losses) >= args.warmup_steps:  # the same warm-up as every other run
                    elapsed += time.perf_counter() - began
                    samples += len(idx)
                losses.append(session.reduce(loss.detach()))  # the mean loss of the global batch
                if len(losses) == 1:
                    first_state = {k: v.detach().cpu().clone() for k, v in bare.state_dict().items()}
        if session.is_main_process:
            with torch.no_grad():
                accuracy = float((bare.eval()(test_x).argmax(dim=1) == data.test_y).float().mean())
            state = {k: v.detach().cpu().clone() for k, v in bare.state_dict().items()}
            speed = samples / elapsed if elapsed else 0.0
            result = {"losses": losses, "accuracy": accuracy, "samples_per_s": speed, "state": state}
            result["first_state"] = first_state
            torch.save({**result, "world_size": session.world_size}, args.out)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one process of the demo's DDP run (started by run_ddp)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--dtype", choices=("float32", "float64"), default=TrainConfig.dtype)
    parser.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    return parser.parse_args(argv)


if __name__ == "__main__":
    _train(_parse(sys.argv[1:]))
