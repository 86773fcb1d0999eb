"""``Session(compile=True)``: ``torch.compile`` applied where torch documents it for each strategy.

- ``single``: the model.
- ``ddp``: the DDP-wrapped model (``torch.compile(DDP(model))``): DDP's forward runs eagerly and
  dynamo's DDP optimizer splits the compiled graph at bucket boundaries, so gradient all-reduce
  still overlaps backward.
- ``fsdp``: the whole model after ``fully_shard`` (blocks, then root): FSDP2's hooks run eagerly at
  each group's boundary and the blocks' computation is compiled between them.
- ``dp``: not compiled (a warning says so): the thread-replica engine copies the module into
  its replicas at every step, which dynamo would retrace instead of speeding up.

The first steps compile (tens of seconds on a CPU); later ones reuse the code. The returned
module's ``state_dict`` keys carry ``_orig_mod.``, which ``session.unwrap``, ``multigpu.save``
and the Checkpointer strip: no saved file contains it.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


def apply_compile(model: nn.Module) -> nn.Module:
    """``torch.compile(model)``; call it on the strategy's wrapped model (DDP / FSDP root).

    Compiling is lazy: the first forward compiles, on every rank.

    Example:
        >>> compiled = apply_compile(nn.Linear(2, 2))
        >>> type(compiled).__name__
        'OptimizedModule'
    """
    return cast(nn.Module, torch.compile(model))
