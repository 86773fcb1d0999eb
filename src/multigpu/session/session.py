"""One training-loop API for every strategy: the same script runs single, dp or ddp.

A complete loop (``examples/train.py`` is the runnable version)::

    with Session(strategy="auto", precision="bf16", accumulate=2) as session:
        model = session.setup_model(build_model())               # moved, wrapped
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = session.build_loader(dataset, batch_size=64)   # the global batch, sharded under ddp
        for epoch in range(3):
            for x, y in session.batches(loader):                 # on the device; ranks stop together
                with session.micro_step(model):                  # autocast; no grad sync while accumulating
                    loss = F.cross_entropy(model(x), y)
                    session.backward(loss)
                session.step(optimizer)                          # steps every `accumulate` micro-steps
            session.print(epoch, session.reduce(loss))           # printed once, averaged over processes

Launch it: ``python train.py`` (single, or dp on several GPUs), ``multigpu launch --strategy dp
train.py``, ``multigpu launch --strategy ddp --nproc-per-node 2 train.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from multigpu.checkpoint.keys import unwrap
from multigpu.devices import DeviceSpec
from multigpu.distributed import collectives, data, runtime
from multigpu.distributed.collectives import ReduceOp
from multigpu.distributed.data import EpochLoader
from multigpu.distributed.failures import explain_collective_failures
from multigpu.errors import ConfigError
from multigpu.parallel.structure import map_leaves
from multigpu.session.ddp_options import DDPOptions
from multigpu.session.fsdp import FSDPOptions
from multigpu.session.precision import PRECISIONS, Precision
from multigpu.session.strategies import STRATEGIES, Strategy, build_strategy

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """How a :class:`Session` trains.

    Attributes:
        strategy: ``single``, ``dp``, ``ddp``, ``fsdp`` or ``auto`` (see :mod:`multigpu.session.strategies`).
        precision: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast and a gradient scaler).
        accumulate: micro-steps per optimizer step (gradient accumulation; 1 = none).
        devices: the devices of ``single`` / ``dp`` (``"cpu:2"``, ``"cuda:0,1"``); None: defaults.
        seed: seeds torch when the session starts (same on every rank) and the loader's shuffle.
        timeout_s: how long a collective waits for a missing rank before failing (ddp); None:
            ``multigpu launch --collective-timeout`` if given, else 600 s.
        ddp: DDP's knobs under ddp (:class:`multigpu.session.ddp_options.DDPOptions`).
        fsdp: how fsdp shards the model (:class:`multigpu.session.fsdp.FSDPOptions`).
        sync_batchnorm: BatchNorm statistics over the global batch under ddp/fsdp (a no-op,
            with a warning, in one process, whose BatchNorm already sees the whole batch).
        compile: ``torch.compile`` the wrapped model (:mod:`multigpu.session.compile`).
    """

    strategy: str = "auto"
    precision: str = "fp32"
    accumulate: int = 1
    devices: DeviceSpec = None
    seed: int = 0
    timeout_s: float | None = None
    ddp: DDPOptions = field(default_factory=DDPOptions)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    sync_batchnorm: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.strategy != "auto" and self.strategy not in STRATEGIES:
            raise ConfigError(
                f"strategy={self.strategy!r} is not one of {['auto', *STRATEGIES]}; use e.g. strategy='ddp'"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is not one of {sorted(PRECISIONS)}; use e.g. 'bf16'")
        if self.accumulate < 1:
            raise ConfigError(f"accumulate={self.accumulate} must be >= 1 (1 = step after every batch)")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ConfigError(f"timeout_s={self.timeout_s} must be > 0 seconds")
        for name, kind in (("ddp", DDPOptions), ("fsdp", FSDPOptions)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} must be a {kind.__name__}; use e.g. {name}={kind.__name__}()"
                )


class Session:
    """The training loop's one handle on strategy, precision, accumulation and collectives.

    Use it as a context manager (or call :meth:`start` and :meth:`close`): under ddp, starting
    joins the process group and closing leaves it, and both must happen on every rank.

    Args:
        config: a :class:`SessionConfig`; or pass its fields as keywords.

    Example:
        >>> with Session(strategy="single") as session:
        ...     model = session.setup_model(nn.Linear(4, 2))
        ...     session.world_size
        1
    """

    def __init__(self, config: SessionConfig | None = None, **fields: Any) -> None:
        if config is not None and fields:
            raise ConfigError(f"pass a SessionConfig or keywords, not both (got keywords {sorted(fields)})")
        self.config = config or SessionConfig(**fields)
        self.strategy: Strategy | None = None
        self.precision: Precision | None = None
        self._micro = 0  # micro-steps since the last optimizer step
        self._last_batch = False  # the batch in flight is the last of session.batches(...)

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> Session:
        """Build the strategy and join the process group (ddp). Every rank must call it."""
        if self.strategy is None:
            strategy = build_strategy(
                self.config.strategy,
                devices=self.config.devices,
                timeout_s=self.config.timeout_s or runtime.collective_timeout_s(),
                ddp=self.config.ddp,
                fsdp=self.config.fsdp,
            )
            strategy.setup()
            self.strategy = strategy
            self.precision = strategy.build_precision(self.config.precision)
            torch.manual_seed(self.config.seed)
        return self

    def close(self) -> None:
        """Leave the process group (ddp). Every rank must call it; safe to call twice."""
        if self.strategy is not None:
            self.strategy.teardown()
            self.strategy = None

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _started(self) -> tuple[Strategy, Precision]:
        if self.strategy is None or self.precision is None:
            raise ConfigError(
                "the session has not started; use 'with Session(...) as session:' or call session.start()"
            )
        return self.strategy, self.precision

    # -- where am I ----------------------------------------------------------------------------

    @property
    def strategy_name(self) -> str:
        return self._started()[0].name

    @property
    def device(self) -> torch.device:
        """Where inputs go (the primary device under dp)."""
        return self._started()[0].device

    @property
    def world_size(self) -> int:
        return self._started()[0].shard.world_size

    @property
    def global_rank(self) -> int:
        return self._started()[0].shard.rank

    @property
    def is_main_process(self) -> bool:
        return self._started()[0].is_main_process

    # -- model and data --------------------------------------------------------------------------

    def setup_model(self, model: nn.Module) -> nn.Module:
        """``model`` moved to the device(s) and wrapped for the strategy. Every rank must call it.

        Build the optimizer afterwards, from the returned model's parameters (under fsdp they are
        new, sharded parameters; an optimizer built before fails at the first :meth:`step`).
        """
        strategy = self._started()[0]
        if self.config.sync_batchnorm:
            model = strategy.apply_sync_batchnorm(model)
        wrapped = strategy.wrap_model(model)
        return strategy.apply_compile(wrapped) if self.config.compile else wrapped

    def build_loader(
        self, dataset: Dataset, batch_size: int, *, shuffle: bool = True, drop_last: bool = True, **loader_kwargs: Any
    ) -> EpochLoader[Any]:
        """A loader of global batches of ``batch_size`` (each ddp process loads its share).

        The epoch advances each time the loader is iterated; see :mod:`multigpu.distributed.data`
        for the shuffle and uneven-dataset policy.
        """
        strategy, _ = self._started()
        return data.build_epoch_loader(
            dataset,
            global_batch=batch_size,
            shard=strategy.shard,
            shuffle=shuffle,
            seed=self.config.seed,
            drop_last=drop_last,
            **loader_kwargs,
        )

    def batches(self, batches: Iterable[T]) -> Iterator[T]:
        """Each batch moved to the device; under ddp all ranks stop at the shortest rank's end.

        The last batch closes the accumulation window even when it is short: the epoch's last
        micro-steps are stepped in that epoch, not mixed into the next one (see :meth:`step`).
        It reads one batch ahead to know which is last. Every rank must iterate it (it agrees on
        the step count with the other ranks).
        """
        device = self.device
        outer = self._last_batch  # an evaluate() inside a training loop must not reset the loop's flag
        ahead = iter(data.even_batches(batches))
        upcoming = next(ahead, _END)
        try:
            while upcoming is not _END:
                batch, upcoming = upcoming, next(ahead, _END)
                self._last_batch = upcoming is _END
                yield _to_device(batch, device)
        finally:
            self._last_batch = outer

    # -- one step -------------------------------------------------------------------------------

    @property
    def should_step(self) -> bool:
        """True when the current micro-step ends an accumulation window (or the batches run out)."""
        return self._micro >= self.config.accumulate or self._last_batch

    def micro_step(self, model: nn.Module) -> AbstractContextManager[Any]:
        """The region of one micro-step's forward and backward: autocast, and no gradient sync
        unless this micro-step completes the accumulation window."""
        strategy, precision = self._started()
        self._micro += 1
        if self.should_step:
            return precision.autocast()
        return _both(strategy.no_sync(model), precision.autocast())

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` averaged over the accumulation window (scaled for fp16)."""
        _, precision = self._started()
        if self.config.accumulate > 1:
            loss = loss / self.config.accumulate
        scaled = precision.scale_loss(loss)
        # DDP all-reduces the gradients inside backward: a rank that stopped turns into an
        # explained CollectiveTimeoutError / PeerExitedError instead of a bare backend error.
        with explain_collective_failures("backward (gradient all-reduce)"):
            if not torch.is_autocast_enabled(self.device.type):
                scaled.backward()
                return
            # Backward outside autocast (as torch recommends), even when called inside micro_step.
            with torch.autocast(self.device.type, enabled=False):
                scaled.backward()

    def step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None) -> bool:
        """Step and zero the gradients at the end of an accumulation window.

        A window cut short by the end of :meth:`batches` (``k`` of ``accumulate`` micro-steps)
        steps on the mean gradient of its ``k`` micro-batches, as one device would on their
        combined batch.

        Args:
            optimizer: the optimizer of the model's parameters.
            max_grad_norm: clip the gradients' total norm to this first (after fp16 unscaling).

        Returns:
            Whether the parameters were updated: False inside a window, and under fp16 when the
            scaler skipped a step whose gradients overflowed (step a scheduler only on True).

        Raises:
            ConfigError: no micro-step ran since the last step (so no gradients to apply).
        """
        strategy, precision = self._started()
        strategy.check_optimizer(optimizer)
        if self._micro == 0:
            raise ConfigError(
                "session.step() found no micro-step since the last step; run the forward and "
                "session.backward(loss) inside 'with session.micro_step(model):' before it"
            )
        if not self.should_step:
            return False
        short = self._micro < self.config.accumulate
        if short or max_grad_norm is not None:
            precision.unscale(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if short:  # backward divided by `accumulate`; this window had fewer micro-steps
                for param in params:
                    param.grad.mul_(self.config.accumulate / self._micro)  # type: ignore[union-attr]
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        stepped = precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        self._micro = 0
        return stepped

    # -- collectives and output ------------------------------------------------------------------

    def reduce(self, value: float | torch.Tensor, op: ReduceOp = "mean") -> float:
        """A scalar metric reduced over every process (mean by default). Every rank must call it."""
        with explain_collective_failures(f"reduce ({op}) of a metric"):
            return float(collectives.reduce_value(value, op).item())

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        """Wait for every rank (no-op in one process). Every rank must call it."""
        with explain_collective_failures("barrier"):
            runtime.barrier()

    def evaluate(self, fn: Callable[[Any], torch.Tensor], dataset: Dataset, batch_size: int) -> torch.Tensor:
        """``fn`` on every sample, each evaluated once over all processes, in dataset order.

        Args:
            fn: maps a batch (on the device) to per-sample results ``[batch, ...]``.
            dataset: a map-style dataset.
            batch_size: the global evaluation batch.

        Returns:
            ``[len(dataset), ...]`` on the CPU, the same on every rank; floating results in
            float32 (autocast may compute them in 16 bits), integer and bool results as they are.
            Every rank must call it.
        """
        strategy, precision = self._started()
        indices = data.shard_indices(dataset, strategy.shard)  # type: ignore[arg-type]
        per_process = max(1, batch_size // strategy.shard.world_size)
        loader = DataLoader(dataset, batch_size=per_process, sampler=indices.tolist())
        results: list[torch.Tensor] = []
        with torch.no_grad(), precision.autocast():
            for batch in self.batches(loader):
                result = fn(batch).detach()
                results.append((result.float() if result.is_floating_point() else result).cpu())
        values = torch.cat(results) if results else torch.empty(0)
        return collectives.gather_by_index(values, indices, len(dataset))  # type: ignore[arg-type]

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The bare model inside the strategy's wrapper (its ``state_dict`` has clean keys)."""
        return unwrap(model)

    def precision_context(self) -> AbstractContextManager[Any]:
        """The precision's autocast region, for forward passes outside :meth:`micro_step`."""
        return self._started()[1].autocast()


@contextmanager
def _both(first: AbstractContextManager[Any], second: AbstractContextManager[Any]) -> Iterator[None]:
    with first, second:
        yield


_END: Any = object()


def _to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device``; the common tuple-of-tensors case without a tree walk."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if type(batch) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in batch):
        return type(batch)(t.to(device, non_blocking=True) for t in batch)
    return map_leaves(lambda leaf, _: leaf.to(device, non_blocking=True) if torch.is_tensor(leaf) else leaf, batch)
