"""Drawn training runs for the Session's differential fuzzer, and the one-device oracle each is checked against.

A :class:`Case` is plain data (it travels to the ddp workers as JSON): a small model drawn from a
vocabulary of layers, a dataset, a global batch, an accumulation count and an optimizer. The same
Session loop (:func:`train_session`) runs it under ``single``, ``dp`` and ``ddp``;
:func:`plain_train` runs it as a plain PyTorch loop on one device. Shared by
``test_differential.py`` and ``ddp_worker.py``.

Not in the vocabulary, on purpose: BatchNorm (each ddp rank and each dp replica normalises its own
part of the batch, as in torch's DDP and nn.DataParallel: a known difference, not a bug), Dropout
in training mode (each strategy draws its own random masks) and parameters that get no gradient
(DDP needs ``find_unused_parameters`` for them).
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multigpu.session import Session

BLOCKS = ("linear", "conv", "norm", "tanh", "gelu", "gru", "twice", "tied")
VOCAB = 11  # token ids of the optional Embedding input


@dataclass(frozen=True, kw_only=True)
class Case:
    seed: int
    samples: int
    batch: int  # the global batch (even: it splits over 2 ranks or 2 replicas)
    accumulate: int
    epochs: int
    blocks: tuple[str, ...] = field(default_factory=tuple)
    channels: int = 2
    length: int = 3
    groups: int = 1
    outputs: int = 2
    tokens: bool = False  # a second, integer input through an Embedding
    classify: bool = False  # cross-entropy on class labels, else MSE on targets
    lr: float = 0.05
    momentum: float = 0.0
    own_loader: bool = False  # the user's DataLoader through session.setup_dataloader

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Case:
        return Case(**{**data, "blocks": tuple(data["blocks"])})


EXAMPLES = int(os.environ.get("MULTIGPU_FUZZ_EXAMPLES", "0")) or None  # a long run's case count


def ddp_cases() -> list[Case]:
    """The cases the ddp launch trains: fixed (the same on every run), 6 in CI."""
    rng = random.Random(20240611)
    return [draw_case(rng) for _ in range(EXAMPLES or 6)]


def draw_case(rng: random.Random) -> Case:
    """One random case: every field from ``rng``."""
    channels = rng.choice([1, 2, 4])
    batch = 2 * rng.randint(1, 5)
    return Case(
        seed=rng.randrange(2**31),
        samples=rng.randint(batch, 4 * batch + 3),
        batch=batch,
        accumulate=rng.randint(1, 3),
        epochs=rng.randint(1, 2),
        blocks=tuple(rng.choice(BLOCKS) for _ in range(rng.randint(1, 4))),
        channels=channels,
        length=rng.randint(1, 4),
        groups=rng.choice([g for g in (1, 2, 4) if channels % g == 0]),
        outputs=rng.randint(2, 4),
        tokens=rng.random() < 0.3,
        classify=rng.random() < 0.5,
        lr=rng.choice([0.01, 0.05, 0.1]),
        momentum=rng.choice([0.0, 0.9]),
        own_loader=rng.random() < 0.3,
    )


class _Conv(nn.Module):
    """Conv1d over the features seen as ``[channels, length]`` (``groups`` > 1 included)."""

    def __init__(self, channels: int, length: int, groups: int) -> None:
        super().__init__()
        self.shape = (channels, length)
        self.conv = nn.Conv1d(channels, channels, kernel_size=3, padding=1, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.view(x.shape[0], *self.shape)).flatten(1)


class _GRU(nn.Module):
    """A GRU over the features seen as a sequence of ``length`` steps of ``channels``."""

    def __init__(self, channels: int, length: int) -> None:
        super().__init__()
        self.shape = (length, channels)
        self.gru = nn.GRU(channels, channels, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x.view(x.shape[0], *self.shape))[0].flatten(1)


class _Twice(nn.Module):
    """One submodule applied twice (its gradient sums both uses)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.inner = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.tanh(self.inner(x)))


class _Tied(nn.Module):
    """Two linear maps sharing one weight (the second uses its transpose)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.encode = nn.Linear(features, features)
        self.decode = nn.Linear(features, features)
        self.decode.weight = self.encode.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.encode(x)), self.decode.weight.t(), self.decode.bias)


class Net(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        features = case.channels * case.length
        build = {
            "linear": lambda: nn.Linear(features, features),
            "conv": lambda: _Conv(case.channels, case.length, case.groups),
            "norm": lambda: nn.LayerNorm(features),
            "tanh": nn.Tanh,
            "gelu": nn.GELU,
            "gru": lambda: _GRU(case.channels, case.length),
            "twice": lambda: _Twice(features),
            "tied": lambda: _Tied(features),
        }
        self.blocks = nn.Sequential(*(build[kind]() for kind in case.blocks))
        self.embed = nn.Embedding(VOCAB, features) if case.tokens else None
        self.head = nn.Linear(features, case.outputs)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is not None:
            x = x + self.embed(tokens)
        return self.head(self.blocks(x))  # type: ignore[no-any-return]


def dataset(case: Case) -> TensorDataset:
    gen = torch.Generator().manual_seed(case.seed)
    x = torch.randn(case.samples, case.channels * case.length, generator=gen)
    inputs = [x, torch.randint(0, VOCAB, (case.samples,), generator=gen)] if case.tokens else [x]
    if case.classify:
        y = torch.randint(0, case.outputs, (case.samples,), generator=gen)
    else:
        y = torch.randn(case.samples, case.outputs, generator=gen)
    return TensorDataset(*inputs, y)


def _loss(case: Case, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y) if case.classify else F.mse_loss(out, y)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def train_session(session: Session, case: Case) -> dict[str, torch.Tensor]:
    """The case with the Session loop, under whatever strategy ``session`` runs (started with ``seed=case.seed``)."""
    model = session.setup_model(Net(case))  # the session's start seeded torch: the same init everywhere
    optimizer = torch.optim.SGD(model.parameters(), lr=case.lr, momentum=case.momentum)
    data = dataset(case)
    if case.own_loader:
        # drop_last: the oracle's whole global batches (drop_last=False pads under ddp, as documented)
        loader: Any = session.setup_dataloader(DataLoader(data, batch_size=case.batch, shuffle=True, drop_last=True))
    else:
        loader = session.build_loader(data, batch_size=case.batch)
    for _ in range(case.epochs):
        for *inputs, y in session.batches(loader):
            with session.micro_step(model):
                session.backward(_loss(case, model(*inputs), y))
            session.step(optimizer)
    return _weights(session.unwrap(model))


def plain_train(case: Case) -> dict[str, torch.Tensor]:
    """The oracle: plain PyTorch on one device, the same global batches, one step per window on its batches."""
    torch.manual_seed(case.seed)
    model = Net(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=case.lr, momentum=case.momentum)
    data = dataset(case)
    usable = case.samples // case.batch * case.batch
    for epoch in range(case.epochs):
        order = torch.randperm(case.samples, generator=torch.Generator().manual_seed(case.seed + epoch))[:usable]
        for start in range(0, usable, case.batch * case.accumulate):
            *inputs, y = data[order[start : start + case.batch * case.accumulate]]
            optimizer.zero_grad()
            _loss(case, model(*inputs), y).backward()  # the window's mean: its micro-batches are equal-sized
            optimizer.step()
    return _weights(model)


def run_case(case: Case, strategy: str, **session_args: Any) -> dict[str, torch.Tensor]:
    """``case`` under ``strategy`` in a fresh Session (under ddp it joins the running process group)."""
    session = Session(strategy=strategy, accumulate=case.accumulate, seed=case.seed, **session_args).start()
    try:
        return train_session(session, case)
    finally:
        session.close()
