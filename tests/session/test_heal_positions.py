"""A replica group that heals inside ``session.step`` goes on with the batches the other groups train next (issue 31).

In one process: the loop's loader is given a position inside ``session.step`` (as torchft's commit
applies a healthy group's state there), and ``session.batches`` drops the batch it read ahead from the
old place; and the position a healthy group sends for that case (after its accumulation window) is
where its own loader stands once the window's step is done.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

from multigpu.session import Session
from multigpu.session.fault_tolerance import LiveState

_EXAMPLES = int(os.environ.get("MULTIGPU_FUZZ_EXAMPLES", "20"))


def _position(state: dict[str, Any]) -> tuple[int, int]:
    return state["epoch"], state["batch"]


@settings(max_examples=_EXAMPLES, derandomize=True, deadline=None)
@given(
    n=st.integers(6, 30),
    batch=st.integers(1, 4),
    accumulate=st.integers(1, 3),
    heal_at=st.integers(1, 12),
    target=st.integers(0, 20),
    at_end=st.booleans(),
)
def test_session_batches_goes_on_from_a_position_loaded_inside_a_step(
    n: int, batch: int, accumulate: int, heal_at: int, target: int, at_end: bool
) -> None:
    passes = 4
    with Session(strategy="single", accumulate=accumulate) as session:
        model = session.setup_model(nn.Linear(1, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        build = lambda: session.build_loader(TensorDataset(torch.arange(float(n))), batch_size=batch)  # noqa: E731
        loader, fresh = build(), build()
        length = len(loader)
        heal_at = 1 + (heal_at - 1) % (passes * -(-length // accumulate))  # a step the loop reaches
        epoch, at = divmod(target, length)
        state = {**loader.state_dict(), "epoch": epoch, "batch": length if at_end else at}
        got: list[list[float]] = []
        healed: tuple[int, int] | None = None  # (batches received before, pass) at the heal
        steps = 0
        for index in range(passes):
            for (x,) in session.batches(loader):
                got.append(x.tolist())
                with session.micro_step(model):
                    session.backward(model(x[:, None]).sum())
                if session.step(optimizer):
                    steps += 1
                    if steps == heal_at:  # torchft's commit applies the received state here
                        loader.load_state_dict(state)
                        healed = (len(got), index)
                        assert _position(loader.state_dict()) == _position(build_at(build, state).state_dict())
        assert healed is not None
        fresh.load_state_dict(state)
        want = [b[0].tolist() for b in fresh]  # the loaded epoch's rest, in the pass that was in flight
        for _ in range(passes - healed[1] - 1):
            want += [b[0].tolist() for b in fresh]
        assert got[healed[0] :] == want
        assert loader.state_dict() == fresh.state_dict()


def build_at(build: Any, state: dict[str, Any]) -> Any:
    loader = build()
    loader.load_state_dict(state)
    return loader


def _windows(
    session: Session, loader: Any, passes: int, iterate: Callable[[Any], Iterable[Any]], **mark: bool
) -> Iterator[tuple[dict[str, Any], int]]:
    """Train ``passes`` passes of ``iterate(loader)`` in the session's accumulation windows; at each window's step,
    the position a healthy group marked at the window's start for a heal inside it, and the loader's epoch then."""
    model = session.setup_model(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    live = LiveState()
    live.add_loader(loader)
    window_open = False
    for _ in range(passes):
        for (x,) in iterate(loader):
            if not window_open:  # the window's first micro-step: where the Session marks it
                live.mark(window_batches=1, accumulate=session.config.accumulate, **mark)
                sent, epoch = live.state_dict()["loaders_after"][0], loader.state_dict()["epoch"]
                window_open = True
            with session.micro_step(model):
                session.backward(model(x[:, None]).sum())
            if session.step(optimizer):
                window_open = False
                yield sent, epoch


@settings(max_examples=_EXAMPLES, derandomize=True, deadline=None)
@given(n=st.integers(6, 30), batch=st.integers(1, 4), accumulate=st.integers(1, 4))
def test_the_position_sent_for_a_heal_inside_a_step_is_the_senders_after_its_window(
    n: int, batch: int, accumulate: int
) -> None:
    with Session(strategy="single", accumulate=accumulate) as session:
        loader = session.build_loader(TensorDataset(torch.arange(float(n))), batch_size=batch)
        windows = 0
        for sent, _ in _windows(session, loader, 3, session.batches):
            windows += 1
            after = build_at(lambda: session.build_loader(loader.dataset, batch_size=batch), sent)
            assert _position(after.state_dict()) == _position(loader.state_dict())
        assert windows >= 3


@settings(max_examples=_EXAMPLES, derandomize=True, deadline=None)
@given(n=st.integers(6, 30), batch=st.integers(1, 4), accumulate=st.integers(2, 4))
def test_the_position_sent_for_a_heal_inside_a_step_of_a_loop_over_the_loader_itself_runs_into_the_next_epoch(
    n: int, batch: int, accumulate: int
) -> None:
    # without session.batches no epoch's end closes a window: a window may end in the next epoch
    with Session(strategy="single", accumulate=accumulate) as session:
        loader = session.build_loader(TensorDataset(torch.arange(float(n))), batch_size=batch)
        windows = 0
        # at least 4 windows, whatever the epoch's length
        for sent, _ in _windows(session, loader, 4 * accumulate, iter, closes_at_epoch_end=False):
            windows += 1
            after = build_at(lambda: session.build_loader(loader.dataset, batch_size=batch), sent)
            assert _position(after.state_dict()) == _position(loader.state_dict())
        assert windows >= 4


def test_a_window_of_a_loop_over_the_loader_itself_sends_the_next_epochs_generator_state() -> None:
    # a loader with its own generator: a position in the next epoch comes with that epoch's generator state
    with Session(strategy="single", accumulate=3) as session:
        data = TensorDataset(torch.arange(10.0))
        build = lambda: session.setup_dataloader(  # noqa: E731
            torch.utils.data.DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1))
        )
        loader = build()
        crossed = 0
        for sent, epoch in _windows(session, loader, 6, iter, closes_at_epoch_end=False):
            after = build_at(build, sent)
            crossed += sent["epoch"] > epoch
            assert after.state_dict().keys() == loader.state_dict().keys()
            for key in ("epoch", "batch", "generator"):
                assert torch.equal(torch.as_tensor(after.state_dict()[key]), torch.as_tensor(loader.state_dict()[key]))
        assert crossed >= 2
