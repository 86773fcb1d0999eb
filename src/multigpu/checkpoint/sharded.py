"""The full weights of a model whose parameters are sharded over the processes (fsdp).

Under FSDP2 a module's ``state_dict()`` holds DTensors: each rank owns a slice of every
parameter. A weights file must hold the whole tensors, so saving gathers them first, with
torch.distributed.checkpoint's state-dict helpers (the keys stay the module's own: ``fully_shard``
adds no prefix). Loading goes the other way: each rank cuts its own slices out of the whole
tensors it read, without communicating. Models that are not sharded pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


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


def shard_like(expected: Mapping[str, object], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (whole, e.g. read from a file) cut into this rank's slices wherever ``expected`` is sharded.

    Args:
        expected: the target model's ``state_dict()`` (DTensors where it is sharded).
        tensors: whole tensors under the same keys (shapes already checked).

    Returns:
        ``tensors`` with each entry whose ``expected`` counterpart is a DTensor turned into a DTensor
        of the same mesh and placements, holding this rank's slice; ready for ``load_state_dict``.

    Does not communicate: every rank holds the whole tensors and keeps its own slice.
    """
    out = dict(tensors)
    for key, value in tensors.items():
        target = expected.get(key)
        if isinstance(target, DTensor):
            # src_data_rank=None: each rank slices its local copy instead of receiving rank 0's.
            out[key] = distribute_tensor(
                value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
            )
    return out
