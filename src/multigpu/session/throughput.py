"""What ``session.log`` adds on its own: step time, samples/s, tokens/s, model FLOPs utilisation, the slow rank.

The Session tells a :class:`Throughput` what happens (the batches it hands out and their waits, each
micro-step, each optimizer step), and :meth:`Throughput.figures` turns the steps since the previous
``log`` into numbers, added to the dict ``session.log`` writes (a metric the caller logs under the same
name wins):

- ``step_time_s``: mean wall time between optimizer steps (everything the loop did in between: data,
  forward, backward, the step, evaluation or a save if the loop did one there).
- ``samples_per_s``: samples of the whole run per second: this process's batches (their first
  dimension) times the number of processes (``session.batches`` keeps the ranks' batches even).
- ``tokens_per_s``: ``samples_per_s`` times ``Session(tokens_per_sample=n)``, when given.
- ``mfu``: model FLOPs utilisation, the FLOPs the model's step needs per second over the peak of every
  device of the run: FLOPs per sample counted once, on the meta device, from the shapes of the model's
  first forward (:func:`multigpu.planning.counting.count_step`), and the device's peak
  (:meth:`multigpu.devices.DeviceType.peak_flops`). On the main process only.
- ``slowest_rank``, ``slowest_rank_ratio``: with several processes, the verdict of a window of
  :mod:`multigpu.runtime.stragglers` (every 50 optimizer steps) completed since the last ``log``; on the
  main process only.

The first optimizer step is not in ``step_time_s`` (it carries one-off work: allocations, lazy
initialisation); the slow-rank watch times it from ``session.batches``' start (its statistic leaves one-off
steps out), so its first window is steps 1-50.
Nothing here is communicated except the slow-rank watch's one exchange per window.
"""

from __future__ import annotations

import copy
import itertools
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from multigpu.devices import get_device_type
from multigpu.errors import ConfigError
from multigpu.planning.counting import count_step
from multigpu.runtime import waits, world
from multigpu.runtime.stragglers import StragglerWatch, Verdict
from multigpu.strategies import Strategy

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class _Window:
    """Timed optimizer steps since the last figures were taken."""

    steps: int = 0
    seconds: float = 0.0
    samples: int = 0


class Throughput:
    """This process's clock of the training loop (see the module docstring).

    Args:
        tokens_per_sample: tokens one sample holds (``tokens_per_s`` is logged when given).
    """

    def __init__(self, tokens_per_sample: int | None = None) -> None:
        self.tokens_per_sample = tokens_per_sample
        self._window = _Window()
        self._last_step: float | None = None  # perf_counter at the last optimizer step
        # Step 1, for the slow-rank watch on every rank: from the first session.batches fetch, else from here
        self._first_began, self._first_fetched = time.perf_counter(), False
        self._optimizer_steps = 0
        self._collective_mark = waits.collective_seconds()  # at the start of the step being timed
        self._data_wait = 0.0  # since the last optimizer step
        self._last_batch_size = 0  # of the batch session.batches handed out last
        self._pending_samples = 0  # micro-batches' samples since the last optimizer step
        self._stragglers: StragglerWatch | None = None  # with several processes
        self._asked_ranks = False
        self._verdict_logged: Verdict | None = None
        self._model: FirstForward | None = None
        self._flops_per_sample: float | None = None
        self._peak: float | None = None
        self._mfu_note: str | None = None  # why there is no mfu (said once)

    # -- what the Session tells it ---------------------------------------------------------------

    def watch_model(self, model: nn.Module) -> None:
        """Keep a meta-device copy of ``model`` (before any wrapper) and the shapes of its first forward."""
        if self._model is None:
            self._model = FirstForward(model)

    def fetch(self, batches: Iterator[Any], end: Any) -> Any:
        """``next(batches, end)``, its wait counted as data wait, less the collectives inside it (the ranks agree
        on the batch count there: waiting for a slower rank is not this rank's loading)."""
        began, in_collectives = time.perf_counter(), waits.collective_seconds()
        if not self._first_fetched:
            self._first_fetched = True
            if self._last_step is None:  # the loop begins: step 1 is timed from here
                self._first_began, self._collective_mark = began, in_collectives
        try:
            return next(batches, end)
        finally:
            self._data_wait += time.perf_counter() - began - (waits.collective_seconds() - in_collectives)

    def handed_out(self, batch: Any) -> None:
        """``session.batches`` yields ``batch``: its samples count once a micro-step trains on it."""
        self._last_batch_size = batch_size(batch)

    def micro_step(self) -> None:
        self._pending_samples += self._last_batch_size
        self._last_batch_size = 0

    def optimizer_step(self, strategy: Strategy, *, joined: bool) -> None:
        """An optimizer step happens now (every rank calls it: the slow-rank watch may exchange here)."""
        now = time.perf_counter()
        self._optimizer_steps += 1
        if not joined:  # under join the ranks step apart: not compared
            interval = now - (self._last_step if self._last_step is not None else self._first_began)
            if self._last_step is not None:  # the first step's one-off work stays out of step_time_s
                self._window.steps += 1
                self._window.seconds += interval
                self._window.samples += self._pending_samples
            if not self._asked_ranks:  # once: the strategy's shard is built anew at each read
                self._asked_ranks = True
                if strategy.shard.world_size > 1 and world.in_process_group():
                    self._stragglers = StragglerWatch(main=strategy.is_main_process)
            if self._stragglers is not None:  # steps 1-50 its first window (step 1 from session.batches' start)
                collective_s = waits.collective_seconds() - self._collective_mark
                compute_s = max(0.0, interval - collective_s - self._data_wait)
                self._stragglers.add(
                    self._optimizer_steps,
                    compute_s=compute_s,
                    data_wait_s=min(self._data_wait, interval),
                    wall_s=interval,
                )
        self._pending_samples = 0
        self._data_wait = 0.0
        self._collective_mark = waits.collective_seconds()  # after the exchange: it is not the next step's
        self._last_step = time.perf_counter()

    # -- what log adds ---------------------------------------------------------------------------

    def figures(self, strategy: Strategy, precision: str) -> dict[str, float]:
        """The figures of the steps since the last call (none when no step was timed since)."""
        window, self._window = self._window, _Window()
        if window.steps == 0 or window.seconds <= 0:
            return {}
        samples_per_s = window.samples * strategy.shard.world_size / window.seconds
        out = {"step_time_s": window.seconds / window.steps}
        if window.samples:
            out["samples_per_s"] = samples_per_s
            if self.tokens_per_sample is not None:
                out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        if strategy.is_main_process:
            if window.samples:
                mfu = self._mfu(samples_per_s, strategy, precision)
                if mfu is not None:
                    out["mfu"] = mfu
            verdict = self._stragglers.latest if self._stragglers is not None else None
            if verdict is not None and verdict is not self._verdict_logged:  # each window's verdict once
                self._verdict_logged = verdict
                out["slowest_rank"] = float(verdict.slowest)
                out["slowest_rank_ratio"] = verdict.ratio
        return out

    def close(self) -> None:
        if self._model is not None:
            self._model.release()

    def _mfu(self, samples_per_s: float, strategy: Strategy, precision: str) -> float | None:
        """FLOPs per sample and the peak, each found once (its time left out of the step); None, said once, when not."""
        if self._mfu_note is not None:
            return None
        if self._flops_per_sample is None or self._peak is None:
            began = time.perf_counter()
            try:
                if self._model is None:
                    raise ConfigError("the model was not set up with session.setup_model")
                self._flops_per_sample = self._model.flops_per_sample()
                self._peak = peak_of_run(strategy.device, _DTYPES[precision], devices_per_process(strategy))
            except Exception as exc:  # whatever the meta copy or the device cannot do: no mfu, training goes on
                self._mfu_note = str(exc)
                print(f"multigpu: no 'mfu' in the log: {exc}", file=sys.stderr, flush=True)
                return None
            finally:
                self._not_the_runs(time.perf_counter() - began)
        return self._flops_per_sample * samples_per_s / (self._peak * strategy.shard.world_size)

    def _not_the_runs(self, seconds: float) -> None:
        """Leave a one-off measurement's ``seconds`` out of the step it happened in (and of this rank's own time)."""
        if self._last_step is not None:
            self._last_step += seconds


def devices_per_process(strategy: Strategy) -> int:
    """The distinct devices this process computes on: dp's GPUs; one CPU however many replicas share it."""
    replicas = getattr(strategy, "replicas", None)  # dp's ReplicaDevices; one device for the others
    return len({r.device for r in replicas}) if replicas else 1


def peak_of_run(device: torch.device, dtype: torch.dtype, devices: int) -> float:
    """FLOP/s of ``devices`` devices like ``device`` (one process's), from the device type's peak (cached per machine)."""
    found = get_device_type(device.type).peak_flops(device, dtype, world.cache_dir() / "peak-flops.json")
    return float(found) * devices


class FirstForward:
    """A meta-device copy of a model and the meta shapes of the real model's first forward (captured by a hook)."""

    def __init__(self, model: nn.Module) -> None:
        self.meta = _meta_copy(model)
        self.args: tuple[Any, ...] | None = None
        self.kwargs: dict[str, Any] = {}
        self.failed: str | None = None if self.meta is not None else f"{type(model).__name__} cannot be copied"
        self._handle = model.register_forward_pre_hook(self._capture, with_kwargs=True)

    def _capture(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.args is not None or torch.compiler.is_compiling():
            return
        self.args, self.kwargs = _as_meta((args, kwargs))
        self._handle.remove()

    def release(self) -> None:
        self._handle.remove()

    def flops_per_sample(self) -> float:
        """FLOPs of one sample's forward and backward, counted on the meta copy (raises ConfigError why not)."""
        if self.failed is not None or self.meta is None:
            raise ConfigError(self.failed or "no copy of the model")
        if self.args is None:
            raise ConfigError("the model's forward was not seen (a compiled model is not watched)")
        first = next((t for t in _tensors((self.args, self.kwargs)) if t.dim() > 0), None)
        if first is None:
            raise ConfigError("the model's first forward got no tensor with a batch dimension")
        replay = _Replay(self.meta, self.args, self.kwargs)
        counted = count_step(replay, first, loss_fn=_mean_square)
        return counted.flops / counted.batch


class _Replay(nn.Module):
    """Calls ``model`` with the captured arguments whatever it is given (count_step passes one tensor)."""

    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self._args, self._kwargs = args, kwargs

    def forward(self, _ignored: torch.Tensor) -> Any:
        return self.model(*self._args, **self._kwargs)


def _meta_copy(model: nn.Module) -> nn.Module | None:
    """``model``'s structure with every parameter and buffer on the meta device (no data copied); None if it won't copy."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # a module holding a lock, a file, a C++ object: no MFU, training goes on
        return None


def _as_meta(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree, device="meta")
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_as_meta(v) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_as_meta(v) for v in tree)
    if isinstance(tree, Mapping):
        return {k: _as_meta(v) for k, v in tree.items()}
    return tree


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        yield from itertools.chain.from_iterable(_tensors(v) for v in tree)
    elif isinstance(tree, Mapping):
        yield from itertools.chain.from_iterable(_tensors(v) for v in tree.values())
    elif hasattr(tree, "__dataclass_fields__"):
        yield from itertools.chain.from_iterable(_tensors(getattr(tree, f)) for f in tree.__dataclass_fields__)


def _mean_square(output: Any) -> torch.Tensor:
    """A stand-in loss: the mean square of the output's first floating tensor (a model's own loss, when it returns one)."""
    found = next((t for t in _tensors(output) if t.is_floating_point()), None)
    if found is None:
        raise ConfigError(f"the model's output ({type(output).__name__}) holds no floating tensor to take a loss of")
    return found.float().square().mean()


def batch_size(batch: Any) -> int:
    """The first dimension of the batch's first tensor (0 when it holds none)."""
    if type(batch) in (tuple, list) and batch and isinstance(batch[0], torch.Tensor):  # (x, y): no walk
        batch = batch[0]
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 0
    first = next((t for t in _tensors(batch) if t.dim() > 0), None)
    return int(first.shape[0]) if first is not None else 0
