"""What session.log adds: step time, samples/s, tokens/s and MFU, checked against a hand count on an MLP.

FLOPs convention (torch's FlopCounterMode, as the planner counts): a matmul of (m x k) by (k x n) is 2mkn,
forward and backward (input and weight gradients), the first layer's input gradient not computed,
elementwise work (biases, activations, the loss) not counted.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from multigpu.devices import get_device_type
from multigpu.errors import ConfigError
from multigpu.session import Session

BATCH, STEPS, SLEEP_S = 16, 6, 0.02


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


# per sample: forward 2*(64*32 + 32*8); backward twice that, less the first layer's input gradient 2*64*32
HAND_FLOPS_PER_SAMPLE = 3 * 2 * (64 * 32 + 32 * 8) - 2 * 64 * 32


def _train(session: Session, model: nn.Module, *, log_every: int = STEPS) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(BATCH, 64), torch.randn(BATCH, 8)) for _ in range(STEPS)]
    for step, (x, y) in enumerate(session.batches(batches), start=1):
        with session.micro_step(model):
            time.sleep(SLEEP_S)  # the step's time is known to be at least this
            session.backward(nn.functional.mse_loss(model(x), y))
        session.step(optimizer)
        if step % log_every == 0:
            session.log({"loss": 1.0}, step)


def _logged(run_dir: Path) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    with (run_dir / "metrics.csv").open() as file:
        for row in csv.DictReader(file):
            found.setdefault(row["metric"], []).append(float(row["value"]))
    return found


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("MULTIGPU_CACHE_DIR", raising=False)  # which would win over XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "multigpu" / "peak-flops.json"


def test_log_adds_step_time_samples_tokens_and_mfu_by_the_hand_count(tmp_path: Path, _cache: Path) -> None:
    with Session(strategy="single", run_dir=tmp_path / "run", tokens_per_sample=128) as session:
        _train(session, session.setup_model(mlp()))
    logged = _logged(tmp_path / "run")
    (step_s,), (samples_s,), (tokens_s,), (mfu,) = (
        logged[k] for k in ("step_time_s", "samples_per_s", "tokens_per_s", "mfu")
    )
    assert step_s >= SLEEP_S
    assert samples_s == pytest.approx(BATCH / step_s)  # the first step is not timed: 5 steps of 16 samples
    assert tokens_s == pytest.approx(samples_s * 128)
    peak = get_device_type("cpu").peak_flops(torch.device("cpu"), torch.float32, _cache)  # the cached figure
    assert mfu == pytest.approx(HAND_FLOPS_PER_SAMPLE * samples_s / peak)


def test_each_log_covers_the_steps_since_the_last_and_the_callers_names_win(tmp_path: Path) -> None:
    with Session(strategy="single", run_dir=tmp_path) as session:
        model = session.setup_model(mlp())
        _train(session, model, log_every=2)  # steps 2, 4, 6: windows of 1, 2 and 2 timed steps
        session.log({"step_time_s": -1.0}, 7)  # no step since: nothing added; a caller's name is its own
    logged = _logged(tmp_path)
    assert len(logged["step_time_s"]) == 4 and logged["step_time_s"][-1] == -1.0
    assert "tokens_per_s" not in logged  # not told the tokens per sample
    assert "slowest_rank" not in logged  # one process: nobody to compare


def test_a_model_the_meta_device_cannot_run_gets_no_mfu_and_trains_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class ReadsAValue(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x) * float(x.abs().max())  # a value: meta tensors have none

    with Session(strategy="single", run_dir=tmp_path) as session:
        _train(session, session.setup_model(ReadsAValue()), log_every=3)
    logged = _logged(tmp_path)
    assert "mfu" not in logged and len(logged["samples_per_s"]) == 2
    assert capsys.readouterr().err.count("multigpu: no 'mfu' in the log") == 1  # said once


def test_dp_replicas_on_one_cpu_share_its_peak(tmp_path: Path, _cache: Path) -> None:
    with Session(strategy="dp", devices="cpu:2", run_dir=tmp_path) as session:
        _train(session, session.setup_model(mlp()))
    logged = _logged(tmp_path)
    peak = get_device_type("cpu").peak_flops(torch.device("cpu"), torch.float32, _cache)
    assert logged["mfu"][0] == pytest.approx(HAND_FLOPS_PER_SAMPLE * logged["samples_per_s"][0] / peak)


def test_a_collective_inside_the_loader_is_waiting_not_data_wait() -> None:
    """session.batches agrees on the batch count with the other ranks inside next(): a fast rank waits there."""
    from multigpu.runtime import waits
    from multigpu.session.throughput import Throughput

    def batches():  # type: ignore[no-untyped-def]
        with waits.timing():  # as collectives.issuing times the agreement
            time.sleep(0.05)
        time.sleep(0.02)  # the loading itself
        yield torch.zeros(2, 3)

    clock = Throughput()
    clock.fetch(batches(), None)
    assert 0.02 <= clock._data_wait < 0.05


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "128"])
def test_tokens_per_sample_must_be_a_count(value: object) -> None:
    with pytest.raises(ConfigError, match=rf"tokens_per_sample={value!r} must be an integer >= 1"):
        Session(strategy="single", tokens_per_sample=value)
