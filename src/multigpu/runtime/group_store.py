"""The store each process group multigpu creates meets its peers in: one per run, a fresh key prefix per group.

Why not ``init_process_group(init_method="tcp://...")`` each time: a process that creates a group,
destroys it and creates another (two Sessions one after the other) reuses torch's keys, because
torch counts its groups from 0 again after ``destroy_process_group`` and, under torchrun, every
group of the run meets in the agent's one store. A rank that reached the second group first read its
peer's address of the first group, still in the store, and waited on it until gloo's timeout (about
one run in three here, plain torch as well). Where rank 0 hosts the store itself (srun, mpirun), a
fast rank could also reach the first group's server just before rank 0 closed it.

So the store is made once per run and kept for the process's life (rank 0's server with it), and each
group gets keys under a prefix no earlier group of this process used. Every rank creates its groups in
the same order (each group is a collective), so the n-th group has the same prefix on every rank.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

_stores: dict[tuple[str, int, int, int], dist.Store] = {}  # (host, port, rank, world size) -> the run's store
_groups_made = 0  # groups this process created through group_store (each has its own key prefix)


def group_store(host: str, port: int, *, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The store for this process's next process group: the run's store (made at the first call), with
    keys under a prefix of this group's own. Every rank must call it, once per group it creates.

    Args:
        host: the rendezvous address (``MASTER_ADDR``; an IPv6 address in brackets).
        port: its port (``MASTER_PORT``); under torchrun the agent hosts the store there, else rank 0.
        rank: this process's global rank.
        world_size: how many processes the run has.
        timeout: how long the store waits for a key (the group's collective timeout).

    Returns:
        A ``PrefixStore`` to pass to ``init_process_group(store=...)``.
    """
    global _groups_made
    key = (host, port, rank, world_size)
    store = _stores.get(key)
    if store is None:
        url = f"tcp://{host}:{port}"
        store, _, _ = next(dist.rendezvous(url, rank=rank, world_size=world_size, timeout=timeout))
        _stores[key] = store
    store.set_timeout(timeout)
    _groups_made += 1
    return dist.PrefixStore(f"multigpu/group-{_groups_made}", store)
