"""CPU replicas share one random generator: a forward that draws from it runs replica by replica, in order.

On CUDA every device has a generator of its own, so a replica's dropout masks depend only on its
device's seed, as under ``nn.DataParallel``. CPU replicas (``"cpu:2"``) have one generator between
them, and threads that draw from it at once take their numbers in the order they reach it: the same
seed gave different masks from run to run, and a resumed run could not follow the uninterrupted one.
So when the module holds a layer that draws in training mode (dropout, ``RReLU``, attention's own
dropout), or deterministic algorithms are on (``Session(deterministic=True)``), the CPU replicas'
forwards take turns: replica 0 first, drawing what one device draws on its chunk, then replica 1, and
so on. Their backwards draw nothing and still overlap, unless a block recomputes its forward in
backward (activation checkpointing: ``Session(activation_checkpointing=...)``, torch's
``checkpoint_wrapper``, a transformers model's ``gradient_checkpointing``): the recompute sets the one
generator to the state of its forward, draws the same masks and sets it back, so two replicas
recomputing at once drew each other's numbers (wrong gradients, silently); their backwards take turns
too. A forward that draws by other means (``torch.rand`` or ``F.dropout`` in your own code, or
``torch.utils.checkpoint`` called in your own forward) is put in turns only under deterministic algorithms.

Example:
    >>> forward_turns(nn.Linear(2, 2), [torch.device("cpu")] * 2) is None   # nothing random: no turns
    True
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

# Layers that draw from the generator in training mode (their `p`, `dropout` or bounds say how much).
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


class Turns:
    """Replicas ``0, 1, ...`` of the CPU enter :meth:`turn` one after another (the others freely)."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        shared = [i for i, device in enumerate(devices) if device.type == "cpu"]
        self._after = {i: shared[k - 1] for k, i in enumerate(shared) if k > 0}  # replica -> the one before
        self._done = {i: threading.Event() for i in shared}

    @contextmanager
    def turn(self, i: int) -> Iterator[None]:
        """Replica ``i``'s forward: after the CPU replica before it has finished its own (or failed)."""
        before = self._after.get(i)
        if before is not None:
            self._done[before].wait()
        try:
            yield
        finally:
            if i in self._done:
                self._done[i].set()


def forward_turns(module: nn.Module, devices: Sequence[torch.device]) -> Turns | None:
    """Turns for the replicas' forwards when CPU replicas would draw from their one generator; None otherwise."""
    if sum(device.type == "cpu" for device in devices) < 2:
        return None
    if torch.are_deterministic_algorithms_enabled() or draws_random(module):
        return Turns(devices)
    return None


def backward_turns(module: nn.Module, devices: Sequence[torch.device]) -> Turns | None:
    """Turns for the replicas' backwards when their forwards take turns and a block recomputes its forward in
    backward (its draws with it); None otherwise: backwards that draw nothing overlap."""
    turns = forward_turns(module, devices)
    return turns if turns is not None and recomputes_in_backward(module) else None


def recomputes_in_backward(module: nn.Module) -> bool:
    """Whether ``module`` holds a block that runs its forward again in backward (activation checkpointing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(
        isinstance(layer, CheckpointWrapper) or getattr(layer, "gradient_checkpointing", False) is True
        for layer in module.modules()
    )


def draws_random(module: nn.Module) -> bool:
    """Whether ``module`` holds a layer that draws random numbers in its current (training) mode."""
    for layer in module.modules():
        if not layer.training:
            continue
        if isinstance(layer, _DROPOUTS) and layer.p > 0:
            return True
        if isinstance(layer, nn.RReLU) or (isinstance(layer, nn.MultiheadAttention) and layer.dropout > 0):
            return True
    return False


def in_turn(turns: Turns | None, i: int) -> Any:
    """``turns.turn(i)``, or nothing to wait for."""
    return nullcontext() if turns is None else turns.turn(i)
