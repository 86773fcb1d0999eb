"""The session API in one process: strategies single and dp against plain PyTorch, and bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multigpu.errors import ConfigError, DeviceError, LaunchError
from multigpu.parallel import DataParallel
from multigpu.session import Session, SessionConfig, build_strategy, resolve_strategy_name
from tests.conftest import free_port
from tests.session.oracle import build_model, plain_train, regression_data


def _session_train(
    session: Session, dataset: TensorDataset, global_batch: int, *, own_loader: bool = False
) -> torch.nn.Module:
    model = session.setup_model(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    if own_loader:
        loader: Any = session.setup_dataloader(DataLoader(dataset, batch_size=global_batch, shuffle=True))
    else:
        loader = session.build_loader(dataset, batch_size=global_batch)
    for _ in range(2):
        for x, y in session.batches(loader):
            with session.micro_step(model):
                session.backward(F.mse_loss(model(x), y))
            session.step(optimizer)
    return session.unwrap(model)


@pytest.mark.parametrize("own_loader", [False, True])
@pytest.mark.parametrize("strategy", ["single", "dp"])
@pytest.mark.parametrize("accumulate", [1, 2, 3])  # 3: each epoch's 4 batches end in a short window
def test_one_process_strategies_match_plain_pytorch(strategy: str, accumulate: int, own_loader: bool) -> None:
    dataset = regression_data(32)
    with Session(strategy=strategy, accumulate=accumulate, devices="cpu:2" if strategy == "dp" else None) as session:
        got = _session_train(session, dataset, global_batch=8, own_loader=own_loader)
    want = plain_train(dataset, global_batch=8, accumulate=accumulate)
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_dp_wraps_in_data_parallel_with_two_cpu_replicas_by_default() -> None:
    with Session(strategy="dp") as session:
        model = session.setup_model(build_model())
    assert isinstance(model, DataParallel)
    assert [d.label for d in model.replica_devices] == ["cpu:0", "cpu:1"]


@pytest.mark.parametrize(
    ("strategy", "devices", "replicas"), [("dp", "cpu:3", 3), ("dp", None, 2), ("single", None, 1)]
)
def test_replicas_count_the_copies_of_the_model_not_the_processes(
    strategy: str, devices: str | None, replicas: int
) -> None:
    # examples/train.py printed "[dp x1]" for two replicas: world_size counts processes
    with Session(strategy=strategy, devices=devices) as session:
        assert (session.world_size, session.replicas) == (1, replicas)


def test_step_only_at_the_end_of_an_accumulation_window() -> None:
    with Session(strategy="single", accumulate=3) as session:
        model = session.setup_model(build_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        stepped = []
        for _ in range(6):
            with session.micro_step(model):
                session.backward(model(torch.randn(4, 6)).sum())
            stepped.append(session.step(optimizer))
    assert stepped == [False, False, True, False, False, True]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_autocasts_the_forward_and_trains(precision: str) -> None:
    dataset = regression_data(64)
    with Session(strategy="single", precision=precision) as session:
        model = session.setup_model(build_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(4):
            for x, y in session.batches(session.build_loader(dataset, batch_size=16)):
                with session.micro_step(model):
                    out = model(x)
                    loss = F.mse_loss(out.float(), y)
                    session.backward(loss)
                session.step(optimizer)
                losses.append(loss.item())
    assert out.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert model[0].weight.dtype == torch.float32  # master weights stay float32
    assert losses[-1] < 0.6 * losses[0]


def test_evaluate_in_one_process_returns_every_sample_in_order() -> None:
    dataset = TensorDataset(torch.arange(7.0))
    with Session(strategy="single") as session:
        got = session.evaluate(lambda batch: batch[0] + 1, dataset, batch_size=3)
    torch.testing.assert_close(got, torch.arange(7.0) + 1)


def test_print_and_reduce_in_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    with Session(strategy="single") as session:
        session.print("hello")
        assert session.reduce(torch.tensor(2.5)) == 2.5
        assert session.is_main_process and session.world_size == 1 and session.global_rank == 0
    assert capsys.readouterr().out == "hello\n"


@pytest.mark.parametrize(("gpus", "on_its_own"), [(0, "single"), (1, "single"), (2, "dp")])
def test_auto_picks_what_the_launcher_asked_for(monkeypatch: pytest.MonkeyPatch, gpus: int, on_its_own: str) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MULTIGPU_STRATEGY"):
        monkeypatch.delenv(key, raising=False)
    # The rule depends on the visible GPUs (multigpu.devices asks torch.cuda): fix them, so the
    # test holds on any machine.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert resolve_strategy_name("auto") == on_its_own  # not launched: dp only for several GPUs
    for asked in ("single", "dp"):  # the launcher's --strategy wins over the GPU count
        monkeypatch.setenv("MULTIGPU_STRATEGY", asked)
        assert resolve_strategy_name("auto") == asked
    monkeypatch.delenv("MULTIGPU_STRATEGY")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_strategy_name("auto") == on_its_own  # a one-process launch is not ddp
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_strategy_name("auto") == "ddp"


# -- bad input -----------------------------------------------------------------------------------


def test_unknown_strategy_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"strategy='zero3' is not one of \['auto', 'single', 'dp', 'ddp', 'fsdp'\]"):
        Session(strategy="zero3")
    with pytest.raises(ConfigError, match="strategy='zero3'"):
        build_strategy("zero3")


def test_unknown_precision_and_bad_accumulation() -> None:
    with pytest.raises(ConfigError, match=r"precision='fp8' is not one of \['bf16', 'fp16', 'fp32'\]"):
        SessionConfig(precision="fp8")
    with pytest.raises(ConfigError, match="accumulate=0 must be an integer >= 1"):
        SessionConfig(accumulate=0)
    with pytest.raises(ConfigError, match="not both"):
        Session(SessionConfig(), strategy="single")


def test_ddp_outside_a_launched_process_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(LaunchError, match=r"strategy 'ddp' needs a launched process.*multigpu launch --strategy ddp"):
        Session(strategy="ddp").start()


def test_one_process_strategy_inside_a_multi_process_launch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"strategy 'single' runs in one process, but this is rank 1 of world_size 2"):
        Session(strategy="single").start()


def test_ddp_devices_must_match_the_processes_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    # Should the check ever stop firing, start() would join a 2-rank group whose other rank never
    # comes: a free port and a 2 s timeout make that a quick failure instead of a 600 s wait.
    launched = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    for key, value in launched.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DeviceError, match=r"names 3 device\(s\) but 2 processes run on this node.*--nproc-per-node 3"):
        Session(strategy="ddp", devices="cpu:3", timeout_s=2).start()


def test_single_with_several_devices_points_to_dp() -> None:
    with pytest.raises(ConfigError, match=r"devices='cpu:2' names 2; use strategy='dp'"):
        Session(strategy="single", devices="cpu:2").start()


def test_using_a_session_before_start_says_how_to_start() -> None:
    with pytest.raises(ConfigError, match="has not started; use 'with Session"):
        Session(strategy="single").setup_model(build_model())


def test_global_batch_that_does_not_divide_names_a_fix() -> None:
    with Session(strategy="single") as session:
        with pytest.raises(ConfigError, match="batch_size=0"):
            session.build_loader(regression_data(8), batch_size=0)


def test_a_dataset_smaller_than_one_global_batch_names_a_batch_that_fits() -> None:
    with Session(strategy="single") as session:
        with pytest.raises(
            ConfigError,
            match=r"has 5 samples, fewer than one global batch of 8, .* use batch_size=5 or drop_last=False",
        ):
            session.build_loader(regression_data(5), batch_size=8)
        assert len(session.build_loader(regression_data(5), batch_size=8, drop_last=False)) == 1


def test_batches_move_nested_batches_and_keep_their_type() -> None:
    with Session(strategy="single") as session:
        (got,) = list(session.batches([{"x": torch.ones(2), "meta": "keep"}]))
    assert got["meta"] == "keep" and got["x"].device == torch.device("cpu")


def test_dp_with_bf16_autocasts_inside_the_replicas() -> None:
    with Session(strategy="dp", precision="bf16", devices="cpu:2") as session:
        model = session.setup_model(build_model())
        with session.micro_step(model):
            out = model(torch.randn(8, 6))
            session.backward(out.float().pow(2).mean())
    assert out.dtype == torch.bfloat16 and out.shape == (8, 2)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_closing_a_ddp_session_releases_the_reducer_before_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import free_port

    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with Session(strategy="ddp") as session:
        model = session.setup_model(nn.Linear(4, 2))
        session.backward(model(torch.randn(3, 4)).sum())
        assert hasattr(model, "reducer")
    assert not hasattr(model, "reducer")  # a DDP model the script still holds no longer pins the group
    assert not torch.distributed.is_initialized()


def test_step_without_a_micro_step_names_the_fix() -> None:
    with Session(strategy="single") as session:
        model = session.setup_model(nn.Linear(2, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        session.backward(model(torch.ones(4, 2)).sum())
        with pytest.raises(
            ConfigError, match=r"no micro-step since the last step; run the forward .*session\.micro_step\(model\)"
        ):
            session.step(optimizer)


def test_fp16_reports_a_skipped_step_and_clips_the_unscaled_gradients() -> None:
    with Session(strategy="single", precision="fp16") as session:
        model = session.setup_model(nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        before = [p.detach().clone() for p in model.parameters()]

        def micro_step() -> None:
            with session.micro_step(model):
                session.backward(model(torch.full((8, 4), 0.5)).float().mean())  # gradient norm 1.1

        micro_step()  # at the initial scale 65536 the bias gradient overflows float16
        assert session.step(optimizer, max_grad_norm=0.1) is False  # skipped: do not step a scheduler
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        micro_step()  # the scale backed off to 32768
        assert session.step(optimizer, max_grad_norm=0.1) is True
        update = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
        # Clipped after unscaling: the update's norm is lr * 0.1 (clipping the scaled gradients
        # would leave it 32768 times smaller).
        torch.testing.assert_close(update.norm(), torch.tensor(0.1), rtol=1e-3, atol=0.0)


def test_evaluate_keeps_integer_results_exact() -> None:
    values = torch.arange(5) + 2**24  # not representable in float32
    with Session(strategy="single") as session:
        got = session.evaluate(lambda batch: batch[0], TensorDataset(values), batch_size=2)
    assert got.dtype == torch.int64 and torch.equal(got, values)


@pytest.mark.parametrize("strategy", ["single", "dp", "ddp", "fsdp"])
def test_a_closed_session_holds_none_of_the_models_optimizers_or_loaders(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc
    import weakref

    if strategy in ("ddp", "fsdp"):  # a group of one, in this process
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        for key, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
            monkeypatch.setenv(key, value)
    session = Session(strategy=strategy, devices="cpu:2" if strategy == "dp" else None)
    with session:
        given = build_model()
        model = session.setup_model(given)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = session.build_loader(regression_data(32), batch_size=8)
        for x, y in session.batches(loader):
            with session.micro_step(model):
                session.backward(F.mse_loss(model(x), y))
            session.step(optimizer)
    held = [weakref.ref(o) for o in (given, model, optimizer, loader)]
    del given, model, optimizer, loader, x, y
    gc.collect()
    # the session object lives on in the script (a notebook's cell, a retry loop): what it trained must not
    assert [ref() is None for ref in held] == [True] * 4
