"""``session.should_stop`` (pre-emption) and ``Session(deterministic=True)`` in one process; the
multi-process agreement is tests/runtime/test_preemption.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.utils.data import TensorDataset

from multigpu.errors import ConfigError
from multigpu.runtime.preemption import StopSignals, agree
from multigpu.session import Session
from multigpu.session.determinism import seed_worker


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_sets_should_stop_once_the_loop_reads_it(sig: signal.Signals) -> None:
    before = signal.getsignal(sig)
    with Session(strategy="single") as session:
        assert signal.getsignal(sig) is before  # nothing installed until the loop reads should_stop
        assert session.should_stop is False
        assert signal.getsignal(sig) is not before
        os.kill(os.getpid(), sig)  # the handler only records it: this process goes on
        assert session.should_stop is True
        assert session.should_stop is True  # stays
    assert signal.getsignal(sig) is before  # close put the previous handler back


def test_stop_signals_record_only_the_first_and_agree_alone() -> None:
    stops = StopSignals()
    assert stops.install() and stops.installed
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stops.restore()
    assert stops.received == signal.SIGUSR1 and not stops.installed
    assert agree(True) is True and agree(False) is False  # outside a process group: the local flag


def test_deterministic_session_sets_and_restores_torch() -> None:
    assert not torch.are_deterministic_algorithms_enabled()
    with Session(strategy="single", deterministic=True) as session:
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        data = TensorDataset(torch.arange(32.0).reshape(16, 2))
        loader = session.build_loader(data, batch_size=4, num_workers=0)
        assert loader.loader.worker_init_fn is seed_worker and loader.loader.generator is not None
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_runs_repeat_exactly() -> None:
    def run() -> torch.Tensor:
        with Session(strategy="single", deterministic=True, seed=5) as session:
            model = session.setup_model(
                torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
            for x, y in session.batches(session.build_loader(data, batch_size=8)):
                with session.micro_step(model):
                    session.backward(torch.nn.functional.mse_loss(model(x), y))
                session.step(optimizer)
            return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(run(), run())


def test_deterministic_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match=r"deterministic='yes' must be True or False"):
        Session(strategy="single", deterministic="yes")  # type: ignore[arg-type]


def test_deterministic_loader_seeds_differ_per_seed_and_rank() -> None:
    from multigpu.session.determinism import seeded_loader_kwargs

    def first_draw(seed: int, rank: int) -> int:
        generator = seeded_loader_kwargs(seed, rank, {})["generator"]
        return int(torch.randint(0, 2**62, (1,), generator=generator))  # type: ignore[call-overload]

    draws = {(seed, rank): first_draw(seed, rank) for seed in range(3) for rank in range(3)}
    assert len(set(draws.values())) == len(draws)  # seed 0 rank 1 is not seed 1 rank 0
    assert first_draw(0, 1) == first_draw(0, 1)
