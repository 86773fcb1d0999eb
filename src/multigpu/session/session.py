"""One training-loop API for every strategy: the same script runs single, dp or ddp.

A complete loop (``examples/train.py`` is the runnable version)::

    with Session(strategy="auto", precision="bf16", accumulate=2) as session:
        model = session.setup_model(build_model())               # moved, wrapped
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = session.build_loader(dataset, batch_size=64)   # the global batch, sharded under ddp
        # or your own: session.setup_dataloader(DataLoader(dataset, batch_size=64, shuffle=True))
        for epoch in range(3):
            for x, y in session.batches(loader):                 # on the device; ranks stop together
                with session.micro_step(model):                  # autocast; no grad sync while accumulating
                    loss = F.cross_entropy(model(x), y)
                    session.backward(loss)
                session.step(optimizer)                          # steps every `accumulate` micro-steps
            session.print(epoch, session.reduce(loss))           # printed once, averaged over processes
            session.log({"loss": session.reduce(loss)}, epoch)    # one metrics.csv, by the main process

Launch it: ``python train.py`` (single, or dp on several GPUs), ``multigpu launch --strategy dp
train.py``, ``multigpu launch --strategy ddp --nproc-per-node 2 train.py``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar, overload

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from multigpu.core.keys import unwrap
from multigpu.core.limits import to_float
from multigpu.core.structure import map_leaves
from multigpu.errors import ConfigError
from multigpu.runtime import collectives, data, exchange, failure_records, loaders, preemption, tracking, world
from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.collectives import ReduceOp
from multigpu.runtime.committed_steps import committed_steps, set_committed_steps
from multigpu.runtime.data import EpochLoader, ShardSpec
from multigpu.runtime.replica_groups import ReplicaSync
from multigpu.runtime.run_identity import keep_identity, release_identity
from multigpu.session import determinism
from multigpu.session.config import SessionConfig
from multigpu.session.coordination import MetricsPosition, seed_rank_streams
from multigpu.session.evaluation import per_sample_result
from multigpu.session.fault_tolerance import LiveState, reseed_after_heal
from multigpu.session.items import ItemWindow
from multigpu.session.metrics import MetricsLog
from multigpu.session.progress import with_progress
from multigpu.session.run_log import RunLog
from multigpu.session.throughput import Throughput
from multigpu.session.toolkit import Toolkit
from multigpu.session.trackers import check_installed, default_trackers
from multigpu.strategies import Precision, Strategy, build_strategy
from multigpu.strategies.activation_checkpointing import apply_activation_checkpointing

T = TypeVar("T")


class Session(Toolkit, RunLog):
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
        self._items = ItemWindow()  # backward(loss, num_items=n): the window's loss sum and item count
        self._last_batch = False  # the batch in flight is the last of session.batches(...)
        self._metrics: MetricsLog | None = None  # created by the first log()
        self._throughput = Throughput(self.config.tokens_per_sample)  # the figures log() adds
        self._rank_streams = False  # each rank's torch generator reseeded (seed_per_rank)
        self._stop_signals = preemption.StopSignals()  # installed by the first read of should_stop
        self._stopping = False  # the ranks agreed to stop (pre-emption)
        self._stop_agreement = preemption.StopAgreement()  # one flag all-reduced per read, a step late
        self._undo_deterministic: Callable[[], None] = _nothing  # deterministic=True's settings, undone on close
        self._live = LiveState()  # global_step, and under --fault-tolerant what a restarted group receives
        self._replicas: ReplicaSync | None = None  # --fault-tolerant: this group's place among the replica groups

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> Session:
        """Build the strategy and join the process group (ddp). Every rank must call it."""
        if self.strategy is None:
            if self.config.debug:  # before the process group exists: torch wraps it in its checks
                tracking.enable_debug()
            strategy = build_strategy(
                self.config.strategy,
                devices=self.config.devices,
                timeout_s=self.config.timeout_s or world.collective_timeout_s(),
                precision=self.config.precision,
                **self.config.strategy_options(),
            )
            check_installed(self.config.trackers or default_trackers())  # on every rank: all fail alike, early
            strategy.setup()
            self.strategy = strategy
            self._replicas = self._maybe_replica_sync()
            self.precision = strategy.build_precision()
            self._live.precision = self.precision  # fp16's scale: what a restarted replica group receives
            torch.manual_seed(self.config.seed)
            set_committed_steps(0)  # this run's count (Checkpointer.resume puts a saved one back)
            keep_identity(self._tracker_runs)  # every checkpoint saves the trackers' runs, resume continues them
            if self.config.deterministic:
                self._undo_deterministic = determinism.apply_deterministic(self.device)
        return self

    def close(self) -> None:
        """Leave the process group (ddp). Every rank must call it; safe to call twice."""
        metrics, self._metrics = self._metrics, None  # a log after close must not reopen the trackers as new runs
        try:
            if metrics is not None:
                metrics.close()  # a tracker that fails to close must not keep this rank in the group
            self._throughput.close()
        finally:
            self._leave()

    def _leave(self) -> None:
        release_identity(self._tracker_runs)
        if self.strategy is not None:
            self._stop_agreement.settle()  # the all-reduce in flight completes before the group closes
        self._stop_signals.restore()
        if self._replicas is not None:
            self._replicas.close()
            self._replicas = None
        self._undo_deterministic()
        self._undo_deterministic = _nothing
        if self.strategy is not None:
            self.strategy.teardown()
            self.strategy = None
        # the model, optimizers and loaders a replica group would have sent: a Session the script keeps (a notebook,
        # a retry loop) must not keep what it trained alive; a restart starts a new LiveState's record
        self._live = LiveState()

    def __enter__(self) -> Session:
        return self.start()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            # on record before closing the group wakes the other ranks with a consequence (see records)
            failure_records.record(exc)
            if self._metrics is not None:  # the trackers that keep a status mark the run failed
                metrics, self._metrics = self._metrics, None
                try:
                    metrics.close(failed=True)
                except Exception as error:  # the loop's exception is the one to raise; say this one
                    warnings.warn(f"a tracker failed to close: {error!r}", RuntimeWarning, stacklevel=2)
        self.close()

    def _maybe_replica_sync(self) -> ReplicaSync | None:
        group, groups, lighthouse, env = world.replica_group(), world.replica_groups(), world.lighthouse_address(), None
        if group is None or groups is None or lighthouse is None:
            return None
        env = world.require_launch_env("a fault-tolerant replica group")
        return ReplicaSync(
            group=group,
            groups=groups,
            lighthouse=lighthouse,
            rank=env.global_rank,
            group_size=env.world_size,
            master_addr=env.master_addr,
            master_port=env.master_port,
            state_dict=self._live.state_dict,
            load_state_dict=self._live.load_state_dict,
            timeout_s=self.config.timeout_s or _REPLICA_TIMEOUT_S,
        )

    def _join_replica_groups(self) -> None:
        if self._replicas is None:  # not fault-tolerant, or closed (a session loader iterated after the session)
            return
        healed_before = self._replicas.healed
        self._replicas.join()
        if self._replicas.healed and not healed_before and self._rank_streams:
            # The received torch state is the sending group's own stream (seed_per_rank): drawing on from it
            # would repeat that group's dropout masks. This rank's stream is drawn anew from its rank and step.
            seed_rank_streams(self.config.seed + committed_steps(), self._data_shard().rank)

    def _data_shard(self) -> ShardSpec:
        """Which share of each global batch this process loads: under --fault-tolerant, its group's share too."""
        shard = self._started()[0].shard
        if self._replicas is None:
            return shard
        return ShardSpec(
            world_size=shard.world_size * self._replicas.groups,
            rank=self._replicas.group * shard.world_size + shard.rank,
        )

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
    def replicas(self) -> int:
        """How many copies of the model train together: processes times dp's replicas per process (times the
        replica groups under ``--fault-tolerant``)."""
        strategy = self._started()[0]
        groups = self._replicas.groups if self._replicas is not None else 1  # --fault-tolerant: every group's
        return strategy.shard.world_size * strategy.replicas_per_process * groups

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes of the run (0 in one process)."""
        return self._started()[0].shard.rank

    @property
    def rank(self) -> int:
        """The same as :attr:`global_rank` (torch.distributed's ``get_rank()``)."""
        return self.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (its GPU index under ddp; 0 in one process)."""
        return self._started()[0].local_rank

    @property
    def is_main_process(self) -> bool:
        return self._started()[0].is_main_process

    @property
    def replica_group(self) -> int:
        """This process's replica group under ``multigpu launch --fault-tolerant`` (0..R-1); 0 otherwise."""
        self._started()
        return world.replica_group() or 0

    @property
    def global_step(self) -> int:
        """The optimizer steps committed in this run (``step`` returned True).

        ``Checkpointer.save`` stores it and ``Checkpointer.resume`` (after the Session started) puts it back;
        a restarted replica group (``--fault-tolerant``) receives it from a healthy one. So
        ``while session.global_step < total:`` is the loop that survives a restart of any kind.
        """
        return committed_steps()

    @global_step.setter
    def global_step(self, value: int) -> None:
        set_committed_steps(value)

    # -- model and data --------------------------------------------------------------------------

    def setup_model(self, model: nn.Module) -> nn.Module:
        """``model`` moved to the device(s) and wrapped for the strategy. Every rank must call it.

        Build the optimizer afterwards, from the returned model's parameters (under fsdp they are
        new, sharded parameters; an optimizer built before fails at the first :meth:`step`). In
        order: sync BatchNorm, activation checkpointing, the strategy's wrapper, ``compile``.

        Raises:
            ConfigError: ``activation_checkpointing`` matches no module, the model itself, or
                modules nested inside each other.
        """
        strategy = self._started()[0]
        if strategy.is_main_process:  # before any wrapper: mfu counts the model's own FLOPs
            self._throughput.watch_model(model)
        self._live.model = model
        if self.config.sync_batchnorm:
            model = strategy.apply_sync_batchnorm(model)
        if self.config.activation_checkpointing is not None:  # before DDP/FSDP wrap the blocks, before compile
            model = apply_activation_checkpointing(model, self.config.activation_checkpointing)  # type: ignore[arg-type]
        wrapped = strategy.wrap_model(model)
        if self._replicas is not None:  # one process per group: DDP's buckets are summed across groups in backward
            self._replicas.watch(wrapped)
        shard = self._data_shard()  # under --fault-tolerant: every group's ranks, one stream each
        if self.config.seed_per_rank and shard.world_size > 1 and not self._rank_streams:
            # the model is built (identical on every rank); from here each rank draws its own masks
            seed_rank_streams(self.config.seed, shard.rank)
            self._rank_streams = True
        return strategy.apply_compile(wrapped) if self.config.compile else wrapped

    def build_loader(
        self, dataset: Dataset, batch_size: int, *, shuffle: bool = True, drop_last: bool = True, **loader_kwargs: Any
    ) -> EpochLoader[Any]:
        """A loader of global batches of ``batch_size`` (each ddp process loads its share).

        The epoch advances each time the loader is iterated; see :mod:`multigpu.runtime.data`
        for the shuffle and uneven-dataset policy.
        """
        strategy, _ = self._started()
        if self.config.deterministic:
            loader_kwargs = determinism.seeded_loader_kwargs(self.config.seed, strategy.shard.rank, loader_kwargs)
        loader = data.build_epoch_loader(
            dataset,
            global_batch=batch_size,
            shard=self._data_shard(),
            shuffle=shuffle,
            seed=self.config.seed,
            drop_last=drop_last,
            **loader_kwargs,
        )
        self._add_loader(loader)
        return loader

    def setup_dataloader(self, loader: DataLoader) -> EpochLoader[Any]:
        """Your DataLoader, rebuilt so that its ``batch_size`` is the global batch, sharded under ddp.

        The map-style dataset gets the per-epoch-seeded sampler of :meth:`build_loader` (the
        loader's shuffle kept, its order drawn from the session's seed); an iterable dataset is
        strided between ranks. ``collate_fn``, workers, ``pin_memory``, ``drop_last`` and the other
        loader settings are kept; what cannot be kept (a custom sampler or batch sampler, a
        DataLoader subclass) is refused. Rules: :mod:`multigpu.runtime.loaders`. Every
        strategy rebuilds it, so one script gets the same global batches anywhere.

        Example:
            >>> loader = session.setup_dataloader(DataLoader(dataset, batch_size=64, shuffle=True))  # doctest: +SKIP

        Raises:
            ConfigError: a loader that cannot be rebuilt (the message says what to do instead), or
                a ``batch_size`` that does not divide by the world size.
        """
        if self.config.deterministic and loader.worker_init_fn is None:
            loader.worker_init_fn = determinism.seed_worker  # kept by the rebuild
        sharded = loaders.shard_dataloader(loader, self._data_shard(), seed=self.config.seed)
        self._add_loader(sharded)
        return sharded

    def _add_loader(self, loader: EpochLoader[Any]) -> None:
        """A session loader's position is sent to restarted replica groups; under --fault-tolerant, a loop over the
        loader itself (not ``session.batches``) joins the other groups before its first batch too."""
        self._live.add_loader(loader)
        if self._replicas is not None:
            loader.before_iteration = self._join_replica_groups

    def batches(
        self, batches: Iterable[T], *, progress: bool = False, description: str = "batches", even_batches: bool = True
    ) -> Iterator[T]:
        """Each batch moved to the device; under ddp all ranks stop at the shortest rank's end.

        The last batch closes the accumulation window even when it is short: the epoch's last
        micro-steps are stepped in that epoch, not mixed into the next one (see :meth:`step`).
        It reads one batch ahead to know which is last. Every rank must iterate it (it agrees on
        the step count with the other ranks). ``progress=True`` draws a progress bar (rich) on
        the main process, labelled ``description``.

        ``even_batches=False`` (inside :meth:`join`) lets each rank take all of its own batches.

        A session loader given a position inside the loop (``loader.load_state_dict``; a replica group
        healed inside :meth:`step`) goes on from there: the batch read ahead from the old place is dropped.

        Raises:
            ConfigError: under ddp, a DataLoader over a map-style dataset that is not sharded
                (every rank would train on every sample): pass it through :meth:`setup_dataloader`;
                ``even_batches=False`` outside ``with session.join(model):``, or with ``accumulate > 1``,
                with several processes.
        """
        loaders.check_sharded(batches, self._data_shard())
        self._join_replica_groups()  # meet the other groups first: a restarted one takes their position here
        if not even_batches and not self._joined and self.world_size > 1:
            raise ConfigError(
                "session.batches(..., even_batches=False) lets ranks take different numbers of batches; "
                "iterate it inside 'with session.join(model):' so finished ranks shadow the others' all-reduces"
            )
        if not even_batches and self.world_size > 1 and self.config.accumulate > 1:
            # A rank that runs out closes its last window early, inside the others' windows: its gradient
            # all-reduce would pair with another rank's next collective (a hang); syncing every micro-step
            # instead gives wrong gradients once a rank has joined (its shadow adds zeros, not its share).
            raise ConfigError(
                f"session.batches(..., even_batches=False) with accumulate={self.config.accumulate}: a rank that "
                "runs out of batches closes its last accumulation window inside the other ranks' windows, and "
                "their gradient all-reduces no longer pair up; use Session(accumulate=1) for uneven inputs "
                "under session.join, or keep even_batches=True (every rank stops at the shortest)"
            )
        device = self.device
        outer = self._last_batch  # an evaluate() inside a training loop must not reset the loop's flag
        outer_position = self._position

        def open_pass() -> tuple[Iterator[T], MetricsPosition]:
            self._position = MetricsPosition(batches)
            ahead: Iterator[T] = iter(data.even_batches(batches) if even_batches else batches)
            if progress and self.is_main_process:
                ahead = with_progress(ahead, total=data.known_len(batches), description=description)
            return ahead, self._position

        ahead, position = open_pass()
        loads = batches.loads if isinstance(batches, EpochLoader) else 0
        upcoming = self._throughput.fetch(ahead, _END)
        try:
            while upcoming is not _END:
                batch, upcoming = upcoming, self._throughput.fetch(ahead, _END)
                self._last_batch = upcoming is _END
                if isinstance(batches, EpochLoader):  # its state counts the batches the loop has received
                    batches.lookahead = 0 if upcoming is _END else 1
                position.next_batch()
                self._throughput.handed_out(batch)
                yield _to_device(batch, device)
                if isinstance(batches, EpochLoader) and batches.loads != loads:
                    # Its position was loaded inside the loop (a replica group healed in session.step): the batch
                    # read ahead came from the old place. Go on from the new one, in a pass that agrees its length.
                    loads, (ahead, position) = batches.loads, open_pass()
                    upcoming = self._throughput.fetch(ahead, _END)
        finally:
            self._last_batch, self._position = outer, outer_position

    # -- one step -------------------------------------------------------------------------------

    @property
    def should_stop(self) -> bool:
        """True on every rank at the same step once SIGTERM or SIGUSR1 reached any rank: save and leave the loop.

        The first read installs the signal handlers (before it, the signals end the process as
        usual); a handler only records the signal. Each read starts an asynchronous all-reduce of
        one flag and answers with the one the previous read started, which completed during the
        step in between (:mod:`multigpu.runtime.preemption`): no added sync point, and the stop
        comes one step after the signal. Every rank must read it at the same point of each step.
        Once True it stays True.

        Example:
            >>> if session.should_stop:  # doctest: +SKIP
            ...     ckpt.save(step=step, model=model, optimizer=optimizer)
            ...     break
        """
        self._started()
        self._stop_signals.install()
        if not self._stopping:
            self._stopping = self._stop_agreement.poll(self._stop_signals.received is not None)
        return self._stopping

    @property
    def should_step(self) -> bool:
        """True when the current micro-step ends an accumulation window (or the batches run out)."""
        return self._micro >= self.config.accumulate or self._last_batch

    def micro_step(self, model: nn.Module) -> AbstractContextManager[Any]:
        """The region of one micro-step's forward and backward: autocast, and no gradient sync
        unless this micro-step completes the accumulation window."""
        strategy, precision = self._started()
        self._micro += 1
        self._throughput.micro_step()
        if self._replicas is not None and self._micro == 1:  # the step's quorum overlaps forward and backward
            if self._replicas.quorum_due:  # what a group behind receives: marked in the steps that run a quorum
                # outside session.batches (a loop over the loader itself) no epoch's end closes a window
                self._live.mark(1, self.config.accumulate, closes_at_epoch_end=self._position is not None)
            self._replicas.begin_step()
        if self.should_step:
            return precision.autocast()
        return _both(strategy.no_sync(model), precision.autocast())

    def backward(self, loss: torch.Tensor, *, num_items: int | torch.Tensor | None = None) -> None:
        """Backward of ``loss``, weighted so that the optimizer step sees the global batch's gradient.

        Without ``num_items``, ``loss`` is this micro-batch's mean and the step follows the mean of
        the window's micro-batch means (each rank and micro-batch weighs the same). With it,
        ``loss`` is the SUM of this micro-batch's per-item losses (tokens, samples) and
        ``num_items`` their count: the step follows the gradient of (all item losses of the window
        on every rank) / (all their items), as one device over the whole global batch does,
        however ragged the micro-batches (:mod:`multigpu.session.items`). It costs one all-reduce
        of two numbers at the step; :attr:`window_loss` is then the window's per-item mean.

        Args:
            loss: the micro-batch's loss (mean; or sum with ``num_items``), one number.
            num_items: the micro-batch's item count: an int >= 0 or a 0-dim tensor (no sync until
                the step), e.g. ``(labels != -100).sum()``; 0 for a micro-batch without items.

        Example:
            >>> loss = F.cross_entropy(logits, labels, reduction="sum", ignore_index=-100)  # doctest: +SKIP
            >>> session.backward(loss, num_items=(labels != -100).sum())  # doctest: +SKIP

        Raises:
            ConfigError: calls with and without ``num_items`` in one accumulation window; a
                ``num_items`` that is not a count; ``num_items`` inside :meth:`join` with several processes.
        """
        _, precision = self._started()
        if num_items is not None and self._joined and self.world_size > 1:
            raise ConfigError(
                "session.backward(loss, num_items=...) inside 'with session.join(model):' with several processes: "
                "the step all-reduces the item count, which a rank that ran out of batches never joins; "
                "use session.backward(loss) with the per-batch mean under join"
            )
        self._items.record(loss, num_items)
        if num_items is None and self.config.accumulate > 1:
            loss = loss / self.config.accumulate
        scaled = precision.scale_loss(loss)
        # DDP all-reduces the gradients inside backward: a rank that stopped turns into an
        # explained CollectiveTimeoutError / PeerExitedError instead of a bare backend error.
        syncs = self.should_step and world.in_process_group()  # DDP all-reduces in this backward
        with collectives.issuing("backward (gradient all-reduce)") if syncs else _no_collective():
            if not torch.is_autocast_enabled(self.device.type):
                scaled.backward()
                return
            # Backward outside autocast (as torch recommends), even when called inside micro_step.
            with torch.autocast(self.device.type, enabled=False):
                scaled.backward()

    @property
    def window_loss(self) -> float | None:
        """The per-item mean loss of the last stepped window over every rank (``session.backward(..., num_items=)``).

        The window's summed losses over its summed items on all ranks, as one device computes the
        mean over the global batch; the same on every rank, with no extra communication (it rides
        on the step's all-reduce of the item count). None before such a step, or after a window
        without items. Log it: ``session.log({"loss": session.window_loss}, step)``.
        """
        return self._items.mean_loss

    def step(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None) -> bool:
        """Step and zero the gradients at the end of an accumulation window.

        A window cut short by the end of :meth:`batches` (``k`` of ``accumulate`` micro-steps)
        steps on the mean gradient of its ``k`` micro-batches, as one device would on their
        combined batch. A window whose backwards were given ``num_items`` steps on the gradient of
        its summed item losses over its summed items on every rank (one all-reduce of two numbers,
        here, on every rank); clipping sees that gradient. With several processes, every 50th step
        the ranks also exchange their step times (one small all-gather: the slow-rank watch,
        :mod:`multigpu.runtime.stragglers`).

        Args:
            optimizer: the optimizer of the model's parameters.
            max_grad_norm: clip the gradients' total norm to this first (after fp16 unscaling).

        Returns:
            Whether the parameters were updated: False inside a window; False when the window
            ran no backward (no parameter has a gradient: the optimizer is not called, so
            momentum and weight decay do not move them either); False when a ``num_items`` window
            held no item on any rank (its gradients are dropped); and under fp16 when the scaler
            skipped a step whose gradients overflowed (step a scheduler only on True).

        Raises:
            ConfigError: no micro-step ran since the last step (so no gradients to apply), or
                ``max_grad_norm`` is not a finite number > 0.
        """
        strategy, precision = self._started()
        strategy.check_optimizer(optimizer)
        if self._micro == 0:
            raise ConfigError(
                "session.step() found no micro-step since the last step; run the forward and "
                "session.backward(loss) inside 'with session.micro_step(model):' before it"
            )
        if max_grad_norm is not None and not _is_positive(max_grad_norm):
            raise ConfigError(f"max_grad_norm={max_grad_norm!r} must be a finite number > 0 (or None: no clipping)")
        if not self.should_step:
            return False
        self._throughput.optimizer_step(strategy, joined=self._joined)  # may exchange (slow-rank watch)
        factor: float | None = None  # what the gradients are multiplied by before clipping and stepping
        if self._items.weighted:  # every rank's window was weighted alike, so every rank all-reduces here
            factor = self._items.settle(strategy.shard.world_size)
            if factor is None:  # no item on any rank: no mean to step on (one device would get 0/0)
                optimizer.zero_grad(set_to_none=True)
                self._micro = 0
                return False
        elif self._micro < self.config.accumulate:  # backward divided by `accumulate`; this window was short
            factor = self.config.accumulate / self._micro
        self._items.reset()
        if not any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
            self._micro = 0  # a window with no backward (e.g. every batch skipped): nothing to apply
            return False
        if self._replicas is not None and not self._committed_across_groups(optimizer):
            optimizer.zero_grad(set_to_none=True)  # a peer group failed during this step: no group applies it
            self._micro = 0
            self._reseed_if_healed()
            return False
        if factor is not None or max_grad_norm is not None:
            precision.unscale(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if factor is not None:
                for param in params:
                    param.grad.mul_(factor)  # type: ignore[union-attr]
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        stepped = precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        self._micro = 0
        if stepped:
            set_committed_steps(committed_steps() + 1)
        self._reseed_if_healed()
        return stepped

    def _reseed_if_healed(self) -> None:
        """After a step in which a replica group healed, every group reseeds alike (from the seed and the step)."""
        if self._replicas is not None and self._replicas.healed_in_step:
            rank = self._data_shard().rank if self._rank_streams else None
            reseed_after_heal(self.config.seed, committed_steps(), rank)

    def _committed_across_groups(self, optimizer: torch.optim.Optimizer) -> bool:
        """Average the gradients over the replica groups alive in this step's quorum; whether to apply them."""
        assert self._replicas is not None
        self._live.attach_optimizer(optimizer)  # what a restarted group receives; a received state applies here
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._replicas.average_gradients(params)
        return self._replicas.commit()

    # -- collectives and output ------------------------------------------------------------------

    @overload
    def reduce(self, value: float, op: ReduceOp = "mean") -> float: ...

    @overload
    def reduce(self, value: Any, op: ReduceOp = "mean") -> Any: ...

    def reduce(self, value: Any, op: ReduceOp = "mean") -> Any:
        """``value`` reduced over every process (mean by default). Every rank must call it.

        A number (Python's or numpy's), a 0-dim tensor or a 0-dim numpy array comes back as a float; a
        larger tensor or array as one of its shape, reduced elementwise; a nested structure (lists,
        tuples, dicts) with each leaf so reduced (:func:`multigpu.runtime.exchange.reduce`, which
        refuses leaves that cannot be reduced and ranks whose shapes disagree, on every rank).
        """
        with explain_collective_failures(f"reduce ({op}) of a metric"):
            reduced = exchange.reduce(value, op)
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
            return float(reduced.item())
        return reduced

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        """Wait for every rank (no-op in one process). Every rank must call it."""
        collectives.barrier()

    def evaluate(self, fn: Callable[[Any], torch.Tensor], dataset: Dataset, batch_size: int) -> torch.Tensor:
        """``fn`` on every sample, each result kept once over all processes, in dataset order.

        When the dataset does not divide by the world size, the last ranks evaluate up to
        ``world_size - 1`` of the first samples a second time (every rank runs the same number of
        forwards, which fsdp's collectives need); those duplicate results are dropped, so ``fn``
        sees those samples twice but the result holds each once.

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
        # its own generator: iterating must not draw from the training's global random stream
        loader = DataLoader(dataset, batch_size=per_process, sampler=indices.tolist(), generator=torch.Generator())
        results: list[torch.Tensor] = []
        with torch.no_grad(), precision.autocast():
            for batch in self.batches(loader):
                result = per_sample_result(fn(batch), batch).detach()
                results.append((result.float() if result.is_floating_point() else result).cpu())
        values = torch.cat(results) if results else torch.empty(0)
        return collectives.gather_by_index(values, indices, len(dataset))  # type: ignore[arg-type]

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The bare model inside the strategy's wrapper (its ``state_dict`` has clean keys)."""
        return unwrap(model)


@contextmanager
def _both(first: AbstractContextManager[Any], second: AbstractContextManager[Any]) -> Iterator[None]:
    with first, second:
        yield


@contextmanager
def _no_collective() -> Iterator[None]:
    yield  # no communication: a micro-step inside an accumulation window, or one process


_END: Any = object()
_REPLICA_TIMEOUT_S = 30.0  # --fault-tolerant: how long a cross-group all-reduce or commit waits for a peer group


def _nothing() -> None:
    pass


def _is_positive(value: object) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(to_float(value)) and value > 0
    )


def _to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device``; the common tuple-of-tensors case without a tree walk."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if type(batch) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in batch):
        return type(batch)(t.to(device, non_blocking=True) for t in batch)
    return map_leaves(lambda leaf, _: leaf.to(device, non_blocking=True) if torch.is_tensor(leaf) else leaf, batch)
