"""Worker for the fsdp tests: every scenario in one launched job (launches are slow).

    multigpu launch --strategy fsdp --nproc-per-node 2 tests/strategies/fsdp_worker.py OUT_DIR [--long]

Each rank writes OUT_DIR/rank<R>.pt with one entry per scenario, and rank 0 the weights file
OUT_DIR/fsdp.safetensors through multigpu.save; tests/strategies/test_fsdp.py compares them with one
device (tests/strategies/strategy_oracle.py). ``--long`` adds the compiled run (slow: it compiles).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests` imports

import multigpu
from multigpu.errors import ConfigError
from multigpu.session import FSDPOptions, Session
from tests.session.oracle import regression_data
from tests.strategies.strategy_oracle import Block, OptimizerFactory, adamw, batchnorm_model, deep_model, sgd


def train(
    session: Session,
    build: Callable[[], nn.Module],
    make_optimizer: OptimizerFactory,
    *,
    max_grad_norm: float | None = None,
) -> dict[str, Any]:
    """Two epochs over 32 samples in global batches of 8; the full weights gathered at the end."""
    model = session.setup_model(build())
    optimizer = make_optimizer(list(model.parameters()))
    loader = session.build_loader(regression_data(32), batch_size=8)
    losses, steps = [], 0
    for _ in range(2):
        for x, y in session.batches(loader):
            with session.micro_step(model):
                loss = F.mse_loss(model(x), y)
                session.backward(loss)
            steps += session.step(optimizer, max_grad_norm=max_grad_norm)
            losses.append(session.reduce(loss.detach()))
    return {"state_dict": full_weights(model), "losses": losses, "steps": steps, "model": model}


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on every rank (a collective): each DTensor gathered."""
    state = multigpu.unwrap(model).state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def bf16(session: Session) -> dict[str, Any]:
    """bf16 precision: record the dtype an inner layer computes in and the dtype the model returns."""
    seen: dict[str, torch.dtype] = {}
    result = train(session, deep_model, adamw)
    model = result["model"]
    inner = multigpu.unwrap(model)[1].inner
    handle = inner.register_forward_hook(lambda _m, args, out: seen.update(input=args[0].dtype))
    with torch.no_grad():
        seen["output"] = model(torch.zeros(4, 6)).dtype
    handle.remove()
    return {**result, "dtypes": seen}


def stale_optimizer(session: Session) -> str:
    """An optimizer built before setup_model: the first step must say so."""
    bare = deep_model()
    optimizer = adamw(list(bare.parameters()))
    model = session.setup_model(bare)
    with session.micro_step(model):
        session.backward(model(torch.zeros(4, 6)).sum())
    try:
        session.step(optimizer)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def scenarios(session: Session, out: Path, long: bool) -> dict[str, Any]:
    def fresh(**kwargs: Any) -> Session:  # further sessions join the group the first one opened
        return Session(strategy="fsdp", **kwargs).start()

    results: dict[str, Any] = {"strategy": session.strategy_name, "world_size": session.world_size}
    results["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES")  # every scenario ran under them
    adam = train(session, deep_model, adamw)
    model = adam.pop("model")
    results["adamw"] = adam
    multigpu.save(model, out / "fsdp.safetensors")  # a collective under fsdp: rank 0 writes
    reloaded = fresh(seed=5).setup_model(deep_model())  # other initial weights, sharded
    multigpu.load(reloaded, out / "fsdp.safetensors")  # each rank keeps its slices of the whole file
    results["reloaded"] = full_weights(reloaded)
    results["unwrapped"] = {"class": type(multigpu.unwrap(model)).__name__, "keys": list(model.state_dict())}
    eleven = TensorDataset(regression_data(11).tensors[0])
    results["evaluate"] = session.evaluate(lambda batch: model(batch[0]), eleven, batch_size=4)
    results["reduce"] = {op: session.reduce(session.global_rank + 1.0, op) for op in ("mean", "sum", "max")}
    results["wrap_block"] = _drop(train(fresh(fsdp=FSDPOptions(wrap=[Block])), deep_model, adamw))
    results["keep_gathered"] = _drop(train(fresh(fsdp=FSDPOptions(reshard_after_forward=False)), deep_model, adamw))
    results["accumulate"] = _drop(train(fresh(accumulate=2), deep_model, adamw))
    results["clip"] = _drop(train(fresh(), deep_model, sgd, max_grad_norm=0.05))
    results["bf16"] = _drop(bf16(fresh(precision="bf16")))
    results["bf16_reduce"] = _drop(
        train(fresh(precision="bf16", fsdp=FSDPOptions(reduce_fp32=False)), deep_model, adamw)
    )
    results["fp16"] = _drop(train(fresh(precision="fp16"), deep_model, adamw))
    results["sync_batchnorm"] = _drop(train(fresh(sync_batchnorm=True), batchnorm_model, sgd))
    results["stale_optimizer"] = stale_optimizer(fresh())
    if long:
        compiled = train(fresh(compile=True), deep_model, adamw)
        multigpu.save(compiled.pop("model"), out / "fsdp-compiled.safetensors")
        results["compile"] = compiled
    return results


def _drop(result: dict[str, Any]) -> dict[str, Any]:
    result.pop("model")
    return result


def main() -> None:
    out = Path(sys.argv[1])
    with Session(strategy="auto", timeout_s=60) as session:  # auto: what `multigpu launch --strategy` asked
        results = scenarios(session, out, long="--long" in sys.argv)
        torch.save(results, out / f"rank{session.global_rank}.pt")


if __name__ == "__main__":
    main()
