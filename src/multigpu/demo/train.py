"""One training run of the demo: the same seed, data order and global batch for every strategy."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from multigpu.core.lookup import lookup
from multigpu.demo.data import Digits
from multigpu.demo.model import build_cnn
from multigpu.errors import ConfigError
from multigpu.profiling.memory import DeviceMemory, track_memory

DTYPES = ("float32", "float64")  # the demo's runs: float32, or float64 to show the rest is rounding


@dataclass(kw_only=True)
class TrainConfig:
    """Knobs shared by every run of the demo."""

    epochs: int = 10  # passes over the 1,438 training images
    batch_size: int = 128  # the global batch: split across the replicas
    lr: float = 0.03  # SGD learning rate (momentum 0.9); larger rates turn float rounding into visible drift
    seed: int = 0  # model initialisation and data order
    dtype: str = "float32"  # "float64" shows that what separates the runs is float32 rounding
    warmup_steps: int = 5  # steps of every run left out of samples/s (first calls allocate and pick kernels)

    def __post_init__(self) -> None:
        lookup(
            dict.fromkeys(DTYPES),
            self.dtype,
            "dtype={value!r} is not one of {choices}; pass dtype='float64' for the exact comparison",
        )
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if not (math.isfinite(self.lr) and self.lr > 0):  # nan trained to nan weights and drew the figures anyway
            raise ConfigError(f"lr={self.lr!r} must be a finite learning rate > 0, e.g. lr=0.03")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed={self.seed} must be from 0 to 2**63 - 1 (torch's seed range), e.g. seed=0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == "float64" else torch.float32


@dataclass(frozen=True)
class Plan:
    """One run of the demo: its name, devices, and how to wrap the bare model."""

    name: str
    devices: str
    wrap: Callable[[nn.Module], nn.Module]
    loss_on_replicas: bool = False  # the wrapper computes the loss: call model(x, target=y)


@dataclass
class RunResult:
    """What one run produced: its loss curve, accuracy, speed and final weights."""

    name: str
    losses: list[float] = field(default_factory=list)
    accuracy: float = 0.0
    samples_per_s: float = 0.0  # over every step but the first warmup_steps
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # final weights
    first_state: dict[str, torch.Tensor] = field(default_factory=dict)  # weights after the first step
    memory: list[DeviceMemory] = field(default_factory=list)  # one measured step, per device


def train_run(plan: Plan, data: Digits, config: TrainConfig, on_step: Callable[[], None] = lambda: None) -> RunResult:
    """Train ``plan.wrap(build_cnn())``, measure one step's memory, evaluate on the test split.

    Args:
        plan: the run's name, devices and wrapper.
        data: the digits.
        config: epochs, batch, learning rate and seed.
        on_step: called after every optimizer step (progress bars).
    """
    torch.manual_seed(config.seed)
    bare = build_cnn().to(config.torch_dtype)
    model = plan.wrap(bare)
    optimizer = torch.optim.SGD(bare.parameters(), lr=config.lr, momentum=0.9)
    order = torch.Generator().manual_seed(config.seed)
    result = RunResult(plan.name)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, target=y) if plan.loss_on_replicas else nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    samples, elapsed = 0, 0.0
    train_x = data.train_x.to(config.torch_dtype)
    for _ in range(config.epochs):
        perm = torch.randperm(len(data.train_y), generator=order)
        for start in range(0, len(perm), config.batch_size):
            idx = perm[start : start + config.batch_size]
            began = time.perf_counter()
            loss = step(train_x[idx], data.train_y[idx])
            if len(result.losses) >= config.warmup_steps:
                elapsed += time.perf_counter() - began
                samples += len(idx)
            result.losses.append(float(loss))
            if len(result.losses) == 1:
                result.first_state = _weights(bare)
            on_step()
    result.memory = _measure_step(
        model, optimizer, lambda: step(train_x[: config.batch_size], data.train_y[: config.batch_size])
    )
    model.eval()
    with torch.no_grad():
        predicted = model(data.test_x.to(config.torch_dtype)).argmax(dim=1)
    result.accuracy = float((predicted == data.test_y).float().mean())
    result.samples_per_s = samples / elapsed if elapsed else 0.0
    result.state = _weights(bare)
    close = getattr(model, "close", None)
    if callable(close):  # DataParallel: release its replica threads now
        close()
    return result


def warm_up(plan: Plan, data: Digits, config: TrainConfig) -> None:
    """A few untimed steps of ``plan`` on a throwaway model, so that no timed run starts cold.

    The first steps in a process pay once for allocator growth and kernel selection; without
    this, whichever run came first would show that cost in its samples/s.
    """
    short = replace(config, epochs=1, warmup_steps=0)
    subset = Digits(
        data.train_x[: 3 * config.batch_size], data.train_y[: 3 * config.batch_size], data.test_x[:8], data.test_y[:8]
    )
    train_run(plan, subset, short)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _measure_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], object]) -> list[DeviceMemory]:
    """Per-device peak memory of one more step, after training (its update is undone)."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with track_memory(model, optimizer) as memory:
        step()
    model.load_state_dict(saved)
    return memory.results()


def steps_per_run(data: Digits, config: TrainConfig) -> int:
    """Optimizer steps in one run (for progress bars)."""
    return config.epochs * -(-len(data.train_y) // config.batch_size)


def max_weight_difference(a: RunResult, b: RunResult, *, first_step: bool = False) -> float:
    """The largest absolute difference between two runs' final weights (or after the first step)."""
    sa, sb = (a.first_state, b.first_state) if first_step else (a.state, b.state)
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)
