"""A model the planner runs for real, left as it was found: its weights, buffers, gradients and the random streams.

:func:`multigpu.planning.counting.count_step` runs a model that is not on the meta device once, and
:func:`~multigpu.planning.counting.measure_workload` times its forward, backward and optimizer steps: on the
user's own model, the steps moved its weights, BatchNorm's running statistics counted the probe's batches,
dropout drew from the process's random streams (torch's, and Python's or numpy's for a forward that draws from
them: the training that follows is not the one the seed gives),
and the gradients it held were dropped, or summed into in place by the probe's first backward (autograd adds
into a gradient that is there). :func:`left_as_found` puts all of it back, with each module's training mode
and each parameter's ``requires_grad``.

Example:
    >>> from torch import nn
    >>> model = nn.Linear(2, 1)
    >>> before = model.weight.clone()
    >>> with left_as_found(model, torch.device("cpu")):
    ...     _ = torch.nn.init.zeros_(model.weight.data)
    >>> torch.equal(model.weight, before)
    True
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from multigpu.devices import get_device_type


@contextlib.contextmanager
def left_as_found(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Run the block, then restore ``model``'s parameters, buffers and gradients (the same tensors, with the values
    they held), its modules' training modes, its parameters' ``requires_grad`` and the random state of the CPU
    (torch's, Python's and numpy's) and of ``device`` (a copy of each tensor with data is held meanwhile: meta tensors hold none)."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if not t.is_meta]
    grads = [(p, p.grad) for p in model.parameters()]
    with torch.no_grad():
        saved = [t.detach().clone() for t in tensors]
        # values too: a backward adds into a gradient that is there, in place (an optimizer may hold the tensor)
        grad_values = [None if g is None or g.is_meta else g.detach().clone() for _, g in grads]
    modes = [(m, m.training) for m in model.modules()]
    wanted = [(p, p.requires_grad) for p in model.parameters()]
    # the device type's object owns its generators (the CPU's and meta's: none of their own)
    accelerator = None if device.type in ("cpu", "meta") else get_device_type(device)
    generators = accelerator.get_rng_state_all() if accelerator is not None else None
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):  # the CPU's stream
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, value in zip(tensors, saved):
                    tensor.copy_(value)
            for (param, grad), held in zip(grads, grad_values):
                param.grad = grad
                if grad is not None and held is not None:
                    with torch.no_grad():
                        grad.copy_(held)
            for module, training in modes:
                module.training = training
            for param, requires_grad in wanted:
                param.requires_grad_(requires_grad)
            random.setstate(python)
            np.random.set_state(numpy_state)
            if accelerator is not None and generators is not None:
                accelerator.set_rng_state_all(generators)
