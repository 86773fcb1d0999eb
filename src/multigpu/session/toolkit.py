"""The Session's loop toolkit: the helpers Accelerate and Fabric users reach for, with their semantics.

:class:`Toolkit` is a base class of :class:`~multigpu.session.Session`; each method is a thin call
into :mod:`multigpu.runtime.exchange` (moving data between ranks) or
:mod:`multigpu.session.coordination` (who goes first, triggers, metrics positions, uneven inputs).
Accelerate's names map one to one (``docs/distributed.md`` has the table)::

    with session.main_process_first():          # rank 0 downloads, the others then read its files
        dataset = build_dataset()
    loader = session.setup_dataloader(DataLoader(dataset, batch_size=64))
    preds = [session.gather_for_metrics(model(x).argmax(1)) for x, _ in session.batches(loader)]
    accuracy = (torch.cat(preds) == labels).float().mean()   # exactly len(dataset) rows, dataset order

Every method that communicates must be called by every rank, in the same order (as any
collective); :meth:`Toolkit.split_between_processes` and :meth:`Toolkit.set_trigger` communicate
nothing. What the ranks pass is checked before any data moves: ranks whose structures, dtypes or
shapes do not fit together all raise :class:`~multigpu.errors.CollectiveMismatchError` naming each
rank's (:mod:`multigpu.runtime.agreement`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from torch import nn

from multigpu.runtime import exchange
from multigpu.runtime.collective_failures import explain_collective_failures
from multigpu.runtime.data import EpochLoader
from multigpu.runtime.resumable import skip_first_batches
from multigpu.session.coordination import MetricsPosition, Trigger, join_uneven, main_first

T = TypeVar("T")


class Toolkit:
    """Gather, broadcast, reduce, pad, split, ordering, triggers, metrics and uneven inputs (mixed into Session).

    The Session provides ``world_size``, ``global_rank``, ``local_rank`` and ``is_main_process``.
    """

    if TYPE_CHECKING:  # the Session's properties

        @property
        def world_size(self) -> int: ...
        @property
        def global_rank(self) -> int: ...
        @property
        def local_rank(self) -> int: ...
        @property
        def is_main_process(self) -> bool: ...

    _trigger: Trigger | None = None
    _position: MetricsPosition | None = None  # of the loader session.batches walks
    _joined = False  # inside session.join(model)

    # -- where am I ----------------------------------------------------------------------------

    @property
    def is_local_main_process(self) -> bool:
        """Whether this process is the first on its node (``local_rank == 0``)."""
        return self.local_rank == 0

    def main_process_first(self) -> AbstractContextManager[None]:
        """A block the main process runs before every other (e.g. download the data once). Every rank must enter it.

        Nested in another ``main_process_first`` block it is part of that one; inside a
        :meth:`local_main_process_first` block it is refused (``ConfigError``). When the main process
        raises inside, the others raise ``PeerExitedError`` instead of running the block.

        Example:
            >>> with session.main_process_first():  # doctest: +SKIP
            ...     dataset = datasets.MNIST("data", download=True)
        """
        return main_first(self.is_main_process, "main_process_first")

    def local_main_process_first(self) -> AbstractContextManager[None]:
        """A block each node's first process runs before the others of its node (e.g. a per-node cache). Every rank must enter it."""
        return main_first(self.is_local_main_process, "local_main_process_first")

    # -- moving data between ranks ---------------------------------------------------------------

    def gather(self, obj: Any) -> Any:
        """``obj``'s tensors (nested in lists, tuples, dicts, dataclasses) from every rank, concatenated on dim 0.

        Rank order; the first dimension may differ per rank; a 0-dim tensor gathers into
        ``[world_size]``. Every rank must call it.

        Raises:
            CollectiveMismatchError: on every rank, when the structures, a dtype or the sizes after dim 0 differ.
        """
        with explain_collective_failures("gather"):
            return exchange.gather(obj)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, as a list in rank order. Every rank must call it."""
        with explain_collective_failures("gather_object"):
            return exchange.gather_object(obj)

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj``'s tensors replaced by rank ``src``'s (same shapes and dtypes on every rank). Every rank must call it.

        Raises:
            CollectiveMismatchError: on every rank, when the structures, a dtype, a shape or ``src`` differ.
        """
        with explain_collective_failures(f"broadcast from rank {src}"):
            return exchange.broadcast(obj, src)

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s picklable ``obj`` on every rank. Every rank must call it."""
        with explain_collective_failures(f"broadcast_object from rank {src}"):
            return exchange.broadcast_object(obj, src)

    def pad_across_processes(self, obj: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """``obj``'s tensors padded on ``dim`` with ``pad_index`` to the largest size of any rank. Every rank must call it.

        Use it before :meth:`gather` for tensors whose other dimensions differ (e.g. generated
        sequences of different lengths).

        Raises:
            CollectiveMismatchError: on every rank, when the structures or a tensor's number of dimensions differ.
        """
        with explain_collective_failures("pad_across_processes"):
            return exchange.pad_across_processes(obj, dim, pad_index, pad_first)

    def gather_for_metrics(self, obj: Any) -> Any:
        """Gather a batch's results for a metric: every sample once, in the one-device order.

        Inside ``session.batches(loader)`` over a loader of ``build_loader`` / ``setup_dataloader``
        (built with ``shuffle=False`` for an evaluation), the rows of all ranks come back in the
        loader's one-device order (dataset order without shuffle), and the rows that the sharding
        repeated to fill the last global batch (``drop_last=False``) are dropped: over an epoch
        exactly ``len(dataset)`` rows. A plain list or tuple without tensors (generated strings) or a numpy array, as ``obj``
        or as a value or item of it, holds one item per sample and is gathered, ordered and cut alike.
        Over any other iterable it is :meth:`gather` (such lists concatenated in rank order). Every rank must call it.
        """
        position = self._position or MetricsPosition(None)
        with explain_collective_failures("gather_for_metrics"):
            return position.gather(obj)

    def split_between_processes(self, items: Any, *, apply_padding: bool = False) -> AbstractContextManager[Any]:
        """This rank's contiguous share of a list, tuple, tensor or dict of them (uneven allowed; communicates nothing).

        A context manager, as in Accelerate. With ``apply_padding`` every share has the largest
        share's size (the last item repeated).

        Example:
            >>> with session.split_between_processes(prompts) as mine:  # doctest: +SKIP
            ...     outputs = [generate(p) for p in mine]
        """
        share = exchange.split_between_processes(items, self.world_size, self.global_rank, apply_padding=apply_padding)
        return _value(share)

    # -- one flag for every rank -------------------------------------------------------------------

    def set_trigger(self) -> None:
        """Raise this rank's flag (e.g. its early-stopping condition holds); :meth:`check_trigger` tells every rank."""
        self._triggers().set()

    def check_trigger(self) -> bool:
        """Whether any rank called :meth:`set_trigger` since the last check (the flag is then lowered). Every rank must call it.

        Example:
            >>> if loss.item() < 0.01: session.set_trigger()  # doctest: +SKIP
            >>> if session.check_trigger(): break              # doctest: +SKIP
        """
        with explain_collective_failures("check_trigger"):
            return self._triggers().check()

    def _triggers(self) -> Trigger:
        if self._trigger is None:
            self._trigger = Trigger()
        return self._trigger

    # -- data position and uneven inputs -----------------------------------------------------------

    def skip_first_batches(self, loader: Any, count: int) -> Iterable[Any]:
        """``loader`` without its first ``count`` batches (their samples are not loaded).

        A session loader skips them in its next iteration only (the epoch after is whole) and is
        returned itself; a plain DataLoader comes back rebuilt to skip them every time it is iterated.
        """
        if isinstance(loader, EpochLoader):
            return loader.skip_first_batches(count)
        return skip_first_batches(loader, count)

    @contextmanager
    def join(self, model: nn.Module, *, divide_by_initial_world_size: bool = True) -> Iterator[None]:
        """Train on uneven inputs: inside it, ``session.batches(b, even_batches=False)`` lets each rank take all of its batches.

        A rank that runs out shadows the gradient all-reduces of the ranks still training (torch's
        ``Join`` over the DDP model). Their gradients are divided by the initial world size
        (``divide_by_initial_world_size``) as DDP does, so a step fewer ranks take is smaller than
        a one-device step over their samples; False divides by the ranks still training. Collectives
        of your own (``reduce``, ``gather``...) are not shadowed: call them after the block. Every rank
        must enter it. A no-op in one process. With several processes its uneven batches need
        ``Session(accumulate=1)``: ranks that run out at different micro-steps would close their last
        accumulation windows apart (``session.batches`` refuses it).

        Raises:
            ConfigError: several processes but ``model`` is not DDP's (fsdp cannot shadow its collectives).
        """
        with join_uneven(model, divide_by_initial_world_size=divide_by_initial_world_size):
            self._joined = True
            try:
                yield
            finally:
                self._joined = False


@contextmanager
def _value(value: T) -> Iterator[T]:
    yield value
