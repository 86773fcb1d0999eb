"""``Session(activation_checkpointing=...)``: the same gradients as without it (dropout included), less memory.

The oracle is the same Session without checkpointing, same seed; ddp and fsdp run on two real gloo
ranks (tests/strategies/checkpointing_worker.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import multigpu
from multigpu.errors import ConfigError
from multigpu.session import Session, SessionConfig
from tests.launching import launch_workers
from tests.strategies.checkpointing_models import Block, Net, build_net, inputs

WORKER = Path(__file__).with_name("checkpointing_worker.py")


def _gradients(strategy: str, choice: Any, **session_args: Any) -> list[torch.Tensor]:
    with Session(strategy=strategy, seed=3, activation_checkpointing=choice, **session_args) as session:
        model = session.setup_model(build_net())
        torch.manual_seed(4)  # dropout's masks: the same stream in both runs
        with session.micro_step(model):
            session.backward(model(inputs()).square().mean())
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize(("strategy", "devices"), [("single", None), ("dp", "cpu:2")])
@pytest.mark.parametrize("choice", [[Block], lambda module: isinstance(module, Block)], ids=["classes", "predicate"])
def test_gradients_equal_a_run_without_it_dropout_included(strategy: str, devices: str | None, choice: Any) -> None:
    plain = _gradients(strategy, None, devices=devices)
    checkpointed = _gradients(strategy, choice, devices=devices)
    assert len(plain) == len(checkpointed)
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # non-reentrant checkpoint replays the RNG state


def test_the_blocks_are_wrapped_before_the_strategy_and_compile() -> None:
    with Session(strategy="single", activation_checkpointing=[Block], compile=True) as session:
        model = session.setup_model(build_net())
    inner = model._orig_mod  # compiled last, around the checkpointed model
    wrapped = [type(m).__name__ for m in inner.blocks]
    assert wrapped == ["CheckpointWrapper"] * 3
    assert list(inner.state_dict()) == list(build_net().state_dict())  # keys of the bare model


def test_state_dict_loads_into_the_bare_model(tmp_path: Path) -> None:
    with Session(strategy="single", activation_checkpointing=[Block]) as session:
        model = session.setup_model(build_net(seed=7))
        multigpu.save(model, tmp_path / "w.pt")
    bare = Net()
    bare.load_state_dict(torch.load(tmp_path / "w.pt"))
    for a, b in zip(bare.state_dict().values(), build_net(seed=7).state_dict().values()):
        assert torch.equal(a, b)


def test_activations_take_less_memory() -> None:
    def peak(choice: Any) -> int:
        with Session(strategy="single", activation_checkpointing=choice) as session:
            model = session.setup_model(build_net(blocks=6, dropout=0.0))
            x = inputs(batch=32, length=32)
            with multigpu.track_memory(model) as memory:
                model(x).square().mean().backward()
            return memory.results()[0].peak - memory.results()[0].resident

    assert peak([Block]) < 0.6 * peak(None)


@pytest.mark.parametrize(
    ("choice", "match"),
    [
        ([nn.Conv2d], r"activation_checkpointing=\[Conv2d\] matches no module of the model; its module classes are \["),
        ([Block, nn.Linear], r"matches 'blocks.0' and 'blocks.0.attn.out_proj' inside it"),
        ([Net], r"matches the model itself \(Net\)"),
        (lambda module: False, r"matches no module of the model"),
    ],
    ids=["no-match", "nested", "root", "predicate-no-match"],
)
def test_a_choice_that_wraps_nothing_or_twice_is_refused(choice: Any, match: str) -> None:
    with (
        Session(strategy="single", activation_checkpointing=choice) as session,
        pytest.raises(ConfigError, match=match),
    ):
        session.setup_model(build_net())


@pytest.mark.parametrize("choice", [3, [], ["Block"], Block()])
def test_a_choice_that_is_not_classes_or_a_predicate_is_refused(choice: Any) -> None:
    with pytest.raises(ConfigError, match=r"activation_checkpointing=.* must be the module classes to recompute"):
        SessionConfig(activation_checkpointing=choice)


def test_one_class_is_taken_as_a_list_of_one() -> None:
    assert SessionConfig(activation_checkpointing=Block).activation_checkpointing == (Block,)


@pytest.mark.multiprocess
def test_ddp_and_fsdp_gradients_equal_a_run_without_it(tmp_path: Path) -> None:
    launch_workers(WORKER, str(tmp_path), nproc=2, timeout_s=180)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for strategy in ("ddp", "fsdp"):
            plain, checkpointed = got[strategy]["plain"], got[strategy]["checkpointed"]
            assert len(plain) == len(checkpointed) > 0
            for a, b in zip(plain, checkpointed):
                torch.testing.assert_close(b, a, rtol=0, atol=0, msg=strategy)
