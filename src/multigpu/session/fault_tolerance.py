"""What a healthy replica group sends a restarted one, and how the restarted one applies it.

Under ``multigpu launch --fault-tolerant`` (:mod:`multigpu.runtime.replica_groups`) a restarted group
does not read a checkpoint: at its first quorum a healthy group sends it this state, live:

- the model's weights and buffers (the unwrapped model's ``state_dict``);
- each optimizer's ``state_dict`` (applied at the restarted group's first ``session.step``, where the
  Session first sees the optimizer), and the state of each of its learning-rate schedulers, found
  without the script's help (:mod:`multigpu.session.lr_schedulers`) and applied with it to the
  schedulers that exist then;
- ``global_step``, the steps committed in this run;
- each session loader's position (:meth:`multigpu.runtime.data.EpochLoader.state_dict`), rewound by
  the batches of the window in flight, so that the restarted group's next batch is the one the others
  train now; and the position after that window, for a group that heals inside the step (a position for
  a loader this group builds after the heal waits for it: :meth:`LiveState.add_loader` applies it);
- the random state: torch's CPU generator, Python's and numpy's;
- the precision's state (fp16's gradient scale: a group at another scale would all-reduce gradients
  scaled otherwise than the others', and skip other steps).

A group that falls behind while alive (left out of a quorum, or a commit vote that failed on it only)
heals inside a later ``session.step`` instead (torchft applies the state in its commit): its loaders
move to the position after the sender's window, the iteration in flight included, and after that step
every group of the quorum reseeds its random streams alike (:func:`reseed_after_heal`).

The snapshot of the small parts (step, positions, random state) is taken on the main thread when the
step's quorum starts (:meth:`LiveState.mark`), before the forward draws from the generators; the
weights and optimizer state are copied when the quorum asks, while they do not change (between the
quorum's start and torchft's commit, which waits for a transfer in flight).
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from multigpu.core.keys import unwrap
from multigpu.errors import ConfigError
from multigpu.runtime.committed_steps import committed_steps, set_committed_steps
from multigpu.runtime.data import EpochLoader, known_len
from multigpu.session.coordination import seed_rank_streams
from multigpu.session.lr_schedulers import check_scheduler_states, load_scheduler_states, scheduler_states
from multigpu.session.peer_state import (
    PEER,
    check_model,
    check_optimizer,
    check_optimizer_form,
    check_precision,
    list_of,
)
from multigpu.strategies import Precision


class LiveState:
    """The state a restarted replica group receives from a healthy one (see the module docstring)."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.precision: Precision | None = None
        self._loaders: list[
            weakref.ref[EpochLoader[Any]]
        ] = []  # in the order the script built them (same in every group)
        self._marked: dict[str, Any] = {}
        self._pending_optimizers: list[dict[str, Any]] | None = None  # received before the optimizer was seen
        self._pending_schedulers: list[list[dict[str, Any]]] = []  # each optimizer's schedulers' (the same)
        # positions received for loaders not built yet, by their index (and the entry's name, for a refusal)
        self._pending_positions: dict[int, tuple[str, Any]] = {}

    def add_loader(self, loader: EpochLoader[Any]) -> None:
        """Send and restore ``loader``'s position (a loader the Session built; the n-th of each group match).

        A position a heal received for the n-th loader before this group built it is applied here (the
        script builds it where the sender's did, before iterating it).

        Raises:
            CheckpointError: that position does not fit ``loader`` (another dataset or batch); nothing applied.
        """
        index = len(self._loaders)
        waiting = self._pending_positions.pop(index, None)
        if waiting is not None:
            name, position = waiting
            try:
                loader.check_state_dict(position)
            except ConfigError as error:
                PEER.fail(f"{name!r}[{index}]", position, f"a position this loader takes ({error})")
            loader.load_state_dict(position)
        self._loaders.append(weakref.ref(loader))

    @property
    def loaders(self) -> list[EpochLoader[Any] | None]:
        return [ref() for ref in self._loaders]

    def mark(self, window_batches: int, accumulate: int, closes_at_epoch_end: bool = True) -> None:
        """Snapshot the step count, the loaders' positions and the random state (at the quorum's start).

        ``window_batches``: the batches of the accumulation window already received, which the position
        gives back (a group healed before its first batch trains them with the others); ``accumulate``:
        the window's length, which the position after the window counts (a group healed inside this step
        goes on from there). ``closes_at_epoch_end``: the epoch's last batch closes the window (``session.batches``);
        False for a loop over the loader itself, whose windows run on into the next epoch.
        """
        starts = [None if loader is None else _rewound(loader, window_batches) for loader in self.loaders]
        self._marked = {
            "global_step": committed_steps(),
            "loaders": starts,
            "loaders_after": [
                None
                if start is None or loader is None
                else _after_window(loader, start, accumulate, closes_at_epoch_end)
                for loader, start in zip(self.loaders, starts)
            ],
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        }

    def state_dict(self) -> dict[str, Any]:
        """What a healthy group sends (called on torchft's quorum thread)."""
        model = {} if self.model is None else {k: _cloned(v) for k, v in unwrap(self.model).state_dict().items()}
        optimizers = [_cloned(opt.state_dict()) for opt in self.optimizers]
        schedulers = [scheduler_states(opt) for opt in self.optimizers]
        precision = {} if self.precision is None else _cloned(self.precision.state_dict())
        return {
            "model": model,
            "optimizers": optimizers,
            "schedulers": schedulers,
            "precision": precision,
            **self._marked,
        }

    def load_state_dict(self, state: dict[str, Any], inside_step: bool = False) -> None:
        """Apply a healthy group's state (the optimizers' at :meth:`attach_optimizer` when not seen yet).

        ``inside_step``: the group heals inside ``session.step`` (it fell behind while alive), not
        before its first batch. The step then commits the other groups' gradients onto the received
        weights, so the loaders go on after the sender's window, and the random state is not applied:
        every group of the quorum reseeds after such a step (:func:`reseed_after_heal`).

        Raises:
            CheckpointError: the state is not one :meth:`state_dict` of this script sends (:meth:`check`); nothing
                of it was applied.
        """
        self.check(state)
        if self.model is not None and state["model"]:
            unwrap(self.model).load_state_dict(state["model"])
        if "global_step" in state:  # a sender that had not begun a step yet sends no position: none to take up
            set_committed_steps(state["global_step"])
        if self.precision is not None and state.get("precision"):
            self.precision.load_state_dict(state["precision"])
        name = "loaders_after" if inside_step else "loaders"
        loaders, self._pending_positions = self.loaders, {}  # a later heal's positions replace those still waiting
        for index, position in enumerate(state.get(name, [])):
            if index >= len(loaders) and position is not None:  # a loader this group builds later: it waits
                self._pending_positions[index] = (name, position)
            elif index < len(loaders) and loaders[index] is not None and position is not None:
                loaders[index].load_state_dict(position)  # type: ignore[union-attr]
        rng = None if inside_step else state.get("rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
        self._pending_optimizers = list(state.get("optimizers", []))
        self._pending_schedulers = list(state.get("schedulers", []))
        for index, optimizer in enumerate(self.optimizers):
            self._apply_pending(index, optimizer)

    def check(self, state: Any) -> None:
        """Refuse (a CheckpointError naming the entry) a received state unlike what this group holds.

        It came from another process: each part is held against this group's own (the weights' names, shapes and
        dtypes, the optimizers' parameter groups and buffers, the schedulers' and the gradient scale's entries, the
        loaders' data, the random generators' forms) before any of it is applied (:mod:`multigpu.session.peer_state`).
        """
        sent = {"model", "optimizers", "schedulers", "precision"}
        marked = {"global_step", "loaders", "loaders_after", "rng"}  # absent all together: the sender had not marked
        if not isinstance(state, Mapping) or set(state) not in (sent, sent | marked):
            PEER.fail("its entries", sorted(state) if isinstance(state, Mapping) else state, f"{sorted(sent | marked)}")
        if self.model is not None:  # a sender runs the same script: it has set up its model too (no weights: refused)
            check_model(unwrap(self.model).state_dict(), state["model"])
        elif not isinstance(state["model"], Mapping):
            PEER.fail("'model'", state["model"], "a mapping of weights")
        if self.precision is not None:
            check_precision(self.precision, state["precision"])
        if "global_step" in state:
            _check_marked(self, state)
        for index, sent_state in enumerate(list_of(state["optimizers"], "'optimizers'")):
            if index >= len(self.optimizers):  # not stepped yet: its form now, the rest when the step shows it
                check_optimizer_form(sent_state, f"'optimizers'[{index}]")
                continue
            if not isinstance(sent_state, dict):
                PEER.fail("'optimizers'[...]", sent_state, "an optimizer's state_dict")
            check_optimizer(PEER, sent_state, self.optimizers[index])
        for index, sent_schedulers in enumerate(list_of(state["schedulers"], "'schedulers'")):
            known = self.optimizers[index] if index < len(self.optimizers) else None  # else the entries' form only
            check_scheduler_states(known, sent_schedulers, index)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember ``optimizer`` (sent to restarted groups); apply a received state that waited for it.

        Its schedulers receive theirs here too: those the script built before this first ``session.step``
        of the optimizer (a scheduler built later starts its own schedule, as at the start of any run).
        """
        if any(optimizer is known for known in self.optimizers):
            return
        index = len(self.optimizers)
        self.optimizers.append(optimizer)
        self._apply_pending(index, optimizer)

    def _apply_pending(self, index: int, optimizer: torch.optim.Optimizer) -> None:
        """Give the ``index``-th optimizer, and its schedulers, the states received for them (if any)."""
        if self._pending_optimizers is not None and index < len(self._pending_optimizers):
            check_optimizer(PEER, self._pending_optimizers[index], optimizer)
            if index < len(self._pending_schedulers):
                check_scheduler_states(optimizer, self._pending_schedulers[index], index)
            optimizer.load_state_dict(self._pending_optimizers[index])
            if index < len(self._pending_schedulers):
                load_scheduler_states(optimizer, self._pending_schedulers[index], index)


def _check_marked(live: LiveState, state: Mapping[str, Any]) -> None:
    """Refuse a step count, loader positions or random states that this group's own cannot take."""
    step = state["global_step"]
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63:
        PEER.fail("'global_step'", step, "a step count (an int >= 0)")
    loaders = live.loaders
    for name in ("loaders", "loaders_after"):
        for index, position in enumerate(list_of(state[name], repr(name))):
            if position is None:
                continue
            if index >= len(loaders):  # a loader not built yet: its form now, the rest when it is built
                _check_position_form(position, f"{name!r}[{index}]")
                continue
            loader = loaders[index]
            try:
                if loader is not None:
                    loader.check_state_dict(position)
            except ConfigError as error:
                PEER.fail(f"{name!r}[{index}]", position, f"a position this loader takes ({error})")
    rng = state["rng"]
    if not isinstance(rng, Mapping) or set(rng) != {"torch", "python", "numpy"}:
        PEER.fail("'rng'", rng, "torch's, Python's and numpy's random states")
    scratch: dict[str, Callable[[Any], Any]] = {
        "torch": torch.Generator().set_state,
        "python": random.Random().setstate,
        "numpy": np.random.RandomState().set_state,
    }
    for name, set_state in scratch.items():
        try:
            set_state(rng[name])  # a generator of its own: this process's are set only when every part passed
        except Exception:  # whatever the generator says, it did not take the state
            PEER.fail(f"'rng'[{name!r}]", rng[name], f"a state of {name}'s generator")


def _check_position_form(position: Any, entry: str) -> None:
    """Refuse what no loader's :meth:`~multigpu.runtime.data.EpochLoader.state_dict` returns."""
    fields = [position.get(k) for k in ("epoch", "batch")] if isinstance(position, Mapping) else [None]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in fields):
        PEER.fail(entry, position, "a loader's position (ints 'epoch' and 'batch' >= 0)")
    if not isinstance(position.get("data", {}), (Mapping, type(None))):
        PEER.fail(entry, position, "a loader's position (its 'data' a mapping)")


def _rewound(loader: EpochLoader[Any], batches: int) -> dict[str, Any]:
    """``loader``'s position ``batches`` batches back (into the previous epoch when this one just ended)."""
    state = loader.state_dict()
    batch, epoch = state["batch"] - batches, state["epoch"]
    if batch < 0 and epoch > 0:  # the window's batches ended the previous epoch
        epoch, batch = epoch - 1, len(loader.loader) + batch
    return {**state, "epoch": epoch, "batch": max(0, batch)}


def _after_window(
    loader: EpochLoader[Any], start: dict[str, Any], accumulate: int, closes_at_epoch_end: bool
) -> dict[str, Any]:
    """The position after an accumulation window that begins at ``start``: ``accumulate`` batches on; or the
    epoch's end where its last batch closes the window (``session.batches``), else as many into the next epochs."""
    length = known_len(loader.loader)
    batch = start["batch"] + accumulate
    if length is None or batch < length:
        return {**start, "batch": batch}
    if closes_at_epoch_end:
        after = {**start, "batch": length}
    else:
        after = {**start, "epoch": start["epoch"] + batch // length, "batch": batch % length}
    if "generator" in start and loader.loader.generator is not None:  # the loader's own generator, from where
        after["generator"] = loader.loader.generator.get_state()  # the next epoch starts: this one drew from it
    return after


def reseed_after_heal(seed: int, step: int, rank: int | None) -> None:
    """Reseed torch's, Python's and numpy's generators from ``seed`` and ``step``, the same in every group.

    Every group of a quorum calls it after a step in which one of them healed: the healed group received
    the sender's random state from before the step, which the step has drawn on since. ``rank``: this
    process's rank among every group's (``seed_per_rank``: torch's stream is its own), or None.
    """
    stream = seed + step
    if rank is None:
        torch.manual_seed(stream)
    else:
        seed_rank_streams(stream, rank)
    random.seed(stream)
    np.random.seed(stream % 2**32)


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value
