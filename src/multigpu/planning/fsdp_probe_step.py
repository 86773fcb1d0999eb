"""The training step both fsdp probes time: a stack of tiny Linear blocks, each its own FSDP2 group, or unsharded.

The blocks are so small that the step's arithmetic is negligible: what a sharded step costs over the unsharded one
is FSDP2's own work per group (its hooks, the gathers' and reduce-scatters' bookkeeping). One process times it in
:func:`multigpu.planning.calibrate.fsdp_group_s` (a group of one, which shards and copies nothing); the machine
probe's two processes time it sharded over both (``planning/_machine_probe_worker.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def tiny_fsdp_step(blocks: int, mesh: Any | None) -> Callable[[], None]:
    """One training step (zero_grad, forward, backward, SGD with momentum) of ``blocks`` Linear(4, 4) blocks:
    each block and the root fully sharded on ``mesh`` (a ``DeviceMesh``), or unsharded where ``mesh`` is None.

    The weights come from a fixed seed (every process of a group builds the same ones) without moving the caller's
    random streams.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(blocks)])
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.ones(2, 4)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    return run
