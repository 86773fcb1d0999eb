"""Worker for the activation-checkpointing tests: gradients with and without it, under ddp and fsdp, one launch.

    multigpu launch --strategy ddp --nproc-per-node 2 tests/strategies/checkpointing_worker.py OUT_DIR

Each rank writes OUT_DIR/rank<R>.pt: ``{strategy: {"plain": grads, "checkpointed": grads}}``, the
full gradients (fsdp's shards gathered) after one backward of the same seeded model, with dropout.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from checkpointing_models import Block, build_net, inputs

from multigpu.session import FSDPOptions, Session


def gradients(strategy: str, checkpointed: bool) -> list[torch.Tensor]:
    fsdp = FSDPOptions(wrap=[Block])
    with Session(strategy=strategy, seed=3, fsdp=fsdp, activation_checkpointing=[Block] if checkpointed else None) as s:
        model = s.setup_model(build_net())
        with s.micro_step(model):
            s.backward(model(inputs(seed=10 + s.global_rank)).square().mean())
        grads = []
        for param in model.parameters():
            grad = param.grad
            grads.append((grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone())
        return grads


def main(out: Path) -> None:
    warnings.filterwarnings("ignore", message="fsdp on cpu in a process started without")
    with Session(strategy="ddp", timeout_s=120) as outer:  # holds the process group for the inner sessions
        results = {s: {"plain": gradients(s, False), "checkpointed": gradients(s, True)} for s in ("ddp", "fsdp")}
        torch.save(results, out / f"rank{outer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
