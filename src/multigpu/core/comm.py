"""Move tensors between replica devices: split, copy, broadcast detached leaves, reduce-add.

One implementation for every device type, with plain ``Tensor.to``. Copies to the device a
tensor is already on are free: they return the tensor itself (or a view of it), which is what
makes CPU replicas cost no copies.

Why it sits below both :mod:`multigpu.parallel` (the engine moves parameters, inputs and
gradients with it) and :mod:`multigpu.profiling` (the bandwidth probe times the very same moves):
neither has to import the other for it. It does not import :mod:`multigpu.devices` either: a
device type's coalesced primitives (CUDA's, one kernel launch per bucket instead of one per
tensor) come in as the ``fast`` argument, which the caller takes from the devices'
type (``multigpu.devices.common_type(devices)``); without it, or where it declines (returns
None), the tensors move one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Coalesced(Protocol):
    """A device type's coalesced copies (:class:`multigpu.devices.DeviceType` has both methods)."""

    def broadcast_coalesced(
        self, tensors: Sequence[torch.Tensor], devices: Sequence[torch.device]
    ) -> list[list[torch.Tensor]] | None: ...

    def reduce_add_coalesced(
        self, per_replica: Sequence[Sequence[torch.Tensor]], destination: torch.device
    ) -> list[torch.Tensor] | None: ...


def split_to_devices(
    tensor: torch.Tensor, sizes: Sequence[int], devices: Sequence[torch.device], dim: int
) -> list[torch.Tensor]:
    """Split ``tensor`` on ``dim`` into ``sizes`` and place chunk i on ``devices[i]`` (differentiable)."""
    if tensor.layout == torch.sparse_coo:  # sparse tensors have no views: copy each chunk out
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        chunks = tuple(tensor.narrow_copy(dim, start, size) for start, size in zip(starts, sizes))
    else:
        chunks = tensor.split(list(sizes), dim)
    return [chunk.to(device, non_blocking=True) for chunk, device in zip(chunks, devices)]


def copy_to_devices(tensor: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """The same tensor on every device in ``devices`` (differentiable)."""
    return [tensor.to(device, non_blocking=True) for device in devices]


def broadcast_detached(
    tensors: Sequence[torch.Tensor], devices: Sequence[torch.device], fast: Coalesced | None = None
) -> list[list[torch.Tensor]]:
    """Detached copies of ``tensors`` on each device, sharing storage where the device is the same.

    Args:
        tensors: the tensors to copy.
        devices: one entry per replica (the same device may repeat).
        fast: the devices' coalesced copies, used when every tensor is on ``devices[0]``.

    Returns:
        ``copies[i][j]`` is tensor j on device i.
    """
    if not tensors:
        return [[] for _ in devices]
    if fast is not None and len(devices) > 1 and all(t.device == devices[0] for t in tensors):
        unique = list(dict.fromkeys(devices))
        copies = fast.broadcast_coalesced([t.detach() for t in tensors], unique)
        if copies is not None:
            by_device = dict(zip(unique, copies))
            # A device named again gets views of its own: replicas sharing leaf objects would sum their
            # gradients into one .grad, which the reduction would then count once per replica.
            seen: set[torch.device] = set()
            rows = []
            for d in devices:
                rows.append([t.detach() for t in by_device[d]] if d in seen else list(by_device[d]))
                seen.add(d)
            return rows
    return [[t.detach().to(device) for t in tensors] for device in devices]


def reduce_add(
    per_replica: Sequence[Sequence[torch.Tensor | None]], destination: torch.device, fast: Coalesced | None = None
) -> list[torch.Tensor | None]:
    """Sum each tensor position across replicas onto ``destination``.

    Args:
        per_replica: ``per_replica[i][j]`` is replica i's tensor j (None: that replica has none).
        destination: where the sums go (the primary device).
        fast: the devices' coalesced reduce, used when every replica has every tensor, each
            replica on a device of its own.

    Returns:
        One sum per position, or None where no replica had a tensor. The replicas' tensors are
        consumed: the first one found may be summed into in place.
    """
    width = len(per_replica[0])
    dense = all(t is not None for row in per_replica for t in row)
    devices = [row[0].device for row in per_replica if row and row[0] is not None]
    if fast is not None and dense and width and len(set(devices)) == len(per_replica):
        coalesced = fast.reduce_add_coalesced(per_replica, destination)  # type: ignore[arg-type]  # dense: no None
        if coalesced is not None:
            return list(coalesced)
    sums: list[torch.Tensor | None] = []
    for j in range(width):
        present = [t for t in (row[j] for row in per_replica) if t is not None]
        if not present:
            sums.append(None)
            continue
        total = present[0].to(destination)
        for tensor in present[1:]:
            total.add_(tensor.to(destination))
        sums.append(total)
    return sums
