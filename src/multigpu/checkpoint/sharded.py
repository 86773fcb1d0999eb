"""The full weights of a model whose parameters are sharded over the processes (fsdp).

Under FSDP2 a module's ``state_dict()`` holds DTensors: each rank owns a slice of every
parameter. A weights file must hold the whole tensors, so saving gathers them first, with
torch.distributed.checkpoint's state-dict helpers (the keys stay the module's own: ``fully_shard``
adds no prefix). Models that are not sharded are returned as they are, without communicating.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def is_sharded(state: Mapping[str, object]) -> bool:
    """Whether any entry of ``state`` is a DTensor (a slice of a tensor spread over the ranks)."""
    return any(isinstance(value, DTensor) for value in state.values())


def full_state_dict(model: nn.Module) -> Mapping[str, torch.Tensor]:
    """``model.state_dict()`` with sharded entries gathered into whole CPU tensors.

    Args:
        model: the bare model (unwrapped).

    Returns:
        For a sharded model: the full state dict on rank 0 and an empty one on the other ranks.
        Otherwise ``model.state_dict()`` on every rank.

    For a sharded model every rank must call it (it all-gathers each tensor); otherwise it does
    not communicate.

    Example:
        >>> list(full_state_dict(nn.Linear(2, 1)))
        ['weight', 'bias']
    """
    state = model.state_dict()
    if not is_sharded(state):
        return state
    # Imported here: torch.distributed.checkpoint is only needed for sharded models.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # One tensor at a time is gathered and moved to the CPU, and kept on rank 0 only: the full
    # model never sits on any device, nor on the other ranks.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(Mapping[str, torch.Tensor], full)
