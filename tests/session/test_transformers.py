"""A Hugging Face GPT-2 (built from a config) end to end: examples/train_gpt.py under every strategy.

Token-summed causal-LM loss over padded ragged batches (``num_items``), bf16, accumulate 4,
``GPT2Block`` checkpointed (and sharded under fsdp), a Checkpointer resume, evaluation through
``gather_for_metrics``. The reference is the same script on one device (``single``); every run
starts at once (``run_together``), since each spends most of its time importing.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launching import ROOT, run_together

# find_spec, not an import: importing transformers takes seconds, which collecting the suite should not pay
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")

SCRIPT = str(ROOT / "examples" / "train_gpt.py")
STEPS = 3


def _argv(strategy: str, out: Path, *extra: str) -> list[str]:
    script = [SCRIPT, "--steps", str(STEPS), "--save-losses", str(out), *extra]
    if strategy == "single":
        return [sys.executable, *script, "--strategy", "single"]
    where = ["--devices", "cpu:2"] if strategy == "dp" else ["--nproc-per-node", "2"]
    return [sys.executable, "-m", "multigpu", "launch", "--strategy", strategy, *where, *script]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("gpt")
    names = ["single", "dp", "ddp", "fsdp"]
    argvs = [_argv(name, out / f"{name}.json") for name in names]
    argvs.append(_argv("single", out / "stopped.json", "--ckpt", str(out / "ckpt"), "--stop-after", "2"))
    done = run_together(argvs, timeout_s=900)
    for argv, result in zip(argvs, done):
        assert result.returncode == 0, f"{argv}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    (resumed,) = run_together([_argv("single", out / "resumed.json", "--ckpt", str(out / "ckpt"))], timeout_s=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in [*names, "resumed"]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["dp", "ddp", "fsdp"])
def test_every_strategy_has_one_devices_per_step_losses(runs: dict[str, dict[str, Any]], strategy: str) -> None:
    want, got = runs["single"]["losses"], runs[strategy]["losses"]
    assert list(got) == list(want) == [str(s) for s in range(1, STEPS + 1)]
    for step in want:  # bf16: the strategies round differently (fsdp casts the weights, not the ops)
        assert got[step] == pytest.approx(want[step], rel=2e-3), (strategy, step)
    assert runs[strategy]["accuracy"] == pytest.approx(runs["single"]["accuracy"], abs=0.03)


@pytest.mark.multiprocess
def test_a_resumed_run_continues_exactly(runs: dict[str, dict[str, Any]]) -> None:
    assert list(runs["resumed"]["losses"]) == [str(s) for s in range(3, STEPS + 1)]
    for step, loss in runs["resumed"]["losses"].items():
        assert loss == runs["single"]["losses"][step]  # bit for bit on the CPU


def test_model_outputs_come_through_dataparallel_and_the_cache_is_turned_off() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_gpt
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from multigpu.session import Session

    batch = train_gpt.pad_batch([train_gpt.CountingSequences(4, seed=0)[i] for i in range(4)])
    losses = {}
    for strategy, devices in (("single", None), ("dp", "cpu:2")):
        model = train_gpt.build_model()
        model.config.use_cache = True  # what from_pretrained gives: the recomputation must not append to it
        with (
            pytest.warns(UserWarning, match=r"set GPT2LMHeadModel.config.use_cache = False"),
            Session(strategy=strategy, devices=devices, activation_checkpointing=[GPT2Block]) as session,
        ):
            wrapped = session.setup_model(model)
            output = wrapped(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            assert type(output).__name__ == "CausalLMOutputWithCrossAttentions"  # gathered field by field
            loss, tokens = train_gpt.token_loss(wrapped, batch)
            with session.micro_step(wrapped):
                session.backward(loss, num_items=tokens)
            losses[strategy] = loss.item() / int(tokens)
    assert losses["dp"] == pytest.approx(losses["single"], rel=1e-5)
    assert torch.isfinite(torch.tensor(list(losses.values()))).all()
