"""Worker for the tests of DDP's knobs, sync BatchNorm and compile: every scenario in one launched job.

    multigpu launch --strategy ddp --nproc-per-node 2 tests/strategies/ddp_options_worker.py OUT_DIR

Each rank writes OUT_DIR/rank<R>.pt with one entry per scenario (and the compiled run's weights
file and checkpoint under OUT_DIR); tests/strategies/test_ddp_options.py compares them with one
device (tests/strategies/strategy_oracle.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests` imports

import multigpu
from multigpu.errors import ConfigError
from multigpu.session import DDPOptions, Session
from tests.session.oracle import regression_data
from tests.strategies.fsdp_worker import train
from tests.strategies.strategy_oracle import Branchy, adamw, batchnorm_model, deep_model, sgd


def unused_branch_fails(session: Session) -> dict[str, Any]:
    """Branchy without find_unused_parameters: the step it fails at and the message."""
    model = session.setup_model(Branchy())
    optimizer = sgd(list(model.parameters()))
    x, y = regression_data(8).tensors
    for step in range(3):
        try:
            with session.micro_step(model):
                session.backward(F.mse_loss(model(x), y))
            session.step(optimizer)
        except ConfigError as exc:
            return {"step": step, "message": str(exc), "cause": type(exc.__cause__).__name__}
    return {"step": None, "message": "no error", "cause": None}


def sync_batchnorm(session: Session) -> dict[str, Any]:
    """The first step's outputs (gathered) and gradients, then the trained weights and an eval pass."""
    model = session.setup_model(batchnorm_model())
    loader = session.build_loader(regression_data(32), batch_size=8)
    x, y = next(iter(session.batches(loader)))
    out = model(x)
    F.mse_loss(out, y).backward()
    first = {
        "inputs": _gather(x),
        "targets": _gather(y),
        "outputs": _gather(out.detach()),
        "grads": {k: p.grad.clone() for k, p in multigpu.unwrap(model).named_parameters()},
    }
    trained = train(Session(strategy="ddp", sync_batchnorm=True).start(), batchnorm_model, sgd)
    model = trained.pop("model")
    model.eval()
    with torch.no_grad():
        trained["eval_outputs"] = model(regression_data(11).tensors[0])
    return {"first": first, "trained": trained}


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, tensor)
    return torch.cat(shards)


def compiled(session: Session, out: Path) -> dict[str, Any]:
    """compile=True with accumulation: gradient sync is off inside accumulating micro-steps; keys stay bare."""
    model = session.setup_model(deep_model())
    optimizer = adamw(list(model.parameters()))
    loader = session.build_loader(regression_data(32), batch_size=8)
    syncs = []
    for _ in range(2):
        for x, y in session.batches(loader):
            with session.micro_step(model):
                syncs.append(model._orig_mod.require_backward_grad_sync)
                session.backward(F.mse_loss(model(x), y))
            session.step(optimizer)
    multigpu.save(model, out / "ddp-compiled.safetensors")
    multigpu.Checkpointer(folder=out / "ckpt").save(step=1, model=model, optimizer=optimizer)
    return {"syncs": syncs, "state_dict": multigpu.unwrap(model).state_dict(), "keys": list(model.state_dict())}


def main() -> None:
    out = Path(sys.argv[1])

    def fresh(**kwargs: Any) -> Session:  # further sessions join the group the first one opened
        return Session(strategy="ddp", **kwargs).start()

    with Session(strategy="ddp", timeout_s=60) as session:
        results: dict[str, Any] = {"unused_fails": unused_branch_fails(session)}
        found = DDPOptions(find_unused_parameters=True)
        results["unused_found"] = train(fresh(ddp=found), Branchy, sgd)
        knobs = DDPOptions(
            static_graph=True, gradient_as_bucket_view=False, bucket_cap_mb=1e-4, broadcast_buffers=False
        )
        results["knobs"] = train(fresh(ddp=knobs), deep_model, sgd)
        for hook in ("fp16", "bf16"):
            results[hook] = train(fresh(ddp=DDPOptions(comm_hook=hook)), deep_model, sgd)
        powersgd = DDPOptions(comm_hook="powersgd", powersgd_start_iter=2)
        results["powersgd"] = train(fresh(ddp=powersgd), deep_model, sgd)
        results["sync_batchnorm"] = sync_batchnorm(fresh(sync_batchnorm=True))
        results["plain_batchnorm"] = train(fresh(), batchnorm_model, sgd)
        # One compiled run (the first compile takes tens of seconds): accumulation, save, checkpoint.
        results["compile"] = compiled(fresh(compile=True, accumulate=2), out)
        for result in results.values():
            result.pop("model", None)
        torch.save(results, out / f"rank{session.global_rank}.pt")


if __name__ == "__main__":
    main()
