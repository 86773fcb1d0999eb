"""Replicate a module onto replica devices for one step.

A replica is a shallow copy of every submodule whose parameters are replaced by tensors on the
replica's device. Two kinds of parameter tensors:

* ``detach=True`` (the default engine): each replica gets *leaf* tensors (``p.detach()`` on the
  primary device, which shares storage and costs nothing; a copy elsewhere). Gradients land on
  the leaves, and :mod:`multigpu.parallel.backward` sums them onto the primary's parameters, so
  every replica's backward can run in its own thread.
* ``detach=False``: replicas use differentiable copies (the primary's own parameters on the
  primary device), and the autograd engine sums the gradients by itself, on one thread on CPU.
  This path supports higher-order gradients (``create_graph=True``).

Buffers (BatchNorm running statistics): replica 0 uses the primary module's own buffers, so
their in-place updates land on the primary, as in nn.DataParallel; other replicas get copies
that are discarded after the step. A buffer that requires grad is differentiated like a
parameter, as torch's ``replicate`` does: every replica's copy takes part in autograd and the
gradients of all replicas are summed onto the primary's buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from multigpu.core import comm
from multigpu.devices import common_type

_LAZY = (
    "Modules with uninitialized parameters can't be used with `DataParallel`. "
    "Run a dummy forward pass to correctly initialize the modules"
)


@dataclass
class Replicas:
    """The replicas of one step and, for the detached engine, their differentiable leaves."""

    modules: list[nn.Module]
    params: list[torch.Tensor]  # the primary's parameters, then its buffers that require grad
    leaves: list[list[torch.Tensor]]  # leaves[i][j]: replica i's tensor for params[j]


def build_replicas(module: nn.Module, devices: Sequence[torch.device], *, detach: bool = True) -> Replicas:
    """Build one replica of ``module`` per device; replica 0 is on the primary device.

    Args:
        module: the module, with its parameters on ``devices[0]``.
        devices: one torch device per replica (the same device may repeat, e.g. CPU replicas).
        detach: leaf parameters per replica (parallel backward) or differentiable copies.

    Returns:
        The replica modules and, in order, the primary's differentiable tensors (parameters, then
        buffers that require grad) and each replica's tensors for them.

    Raises:
        RuntimeError: the module has uninitialized (lazy) parameters, with nn.DataParallel's message.
    """
    params: list[torch.Tensor] = list(module.parameters())
    if any(is_lazy(p) for p in params):
        raise RuntimeError(_LAZY)
    buffers = list(module.buffers())
    params += [b for b in buffers if b.requires_grad]
    buffers = [b for b in buffers if not b.requires_grad]
    if detach:
        leaves = comm.broadcast_detached(params, devices, common_type(devices))  # coalesced where the type can
        for row in leaves:
            for leaf, param in zip(row, params):
                leaf.requires_grad_(param.requires_grad)
    else:
        leaves = [[param if param.device == device else param.to(device) for param in params] for device in devices]
    buffer_copies = [buffers] + [[b.detach().to(device, copy=True) for b in buffers] for device in devices[1:]]
    modules = [
        _rebuild(module, {**dict(zip(map(id, params), row)), **dict(zip(map(id, buffers), bufs))})
        for row, bufs in zip(leaves, buffer_copies)
    ]
    return Replicas(modules=modules, params=params, leaves=leaves)


def _rebuild(module: nn.Module, tensors: dict[int, torch.Tensor]) -> nn.Module:
    """A shallow copy of the module tree with parameters and buffers swapped by identity."""
    copies: dict[int, nn.Module] = {}
    for sub in module.modules():
        copies[id(sub)] = sub._replicate_for_data_parallel()
    for sub in module.modules():
        replica = copies[id(sub)]
        for name, child in sub._modules.items():
            replica._modules[name] = None if child is None else copies[id(child)]
        for name, param in sub._parameters.items():
            replica._parameters[name] = None if param is None else tensors[id(param)]  # type: ignore[assignment]
        for name, buf in sub._buffers.items():
            replica._buffers[name] = None if buf is None else tensors[id(buf)]
    return copies[id(module)]
