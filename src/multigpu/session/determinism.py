"""``Session(deterministic=True)``: the same numbers run after run, on the same machine and versions.

What it switches on, and what each costs:

- ``torch.use_deterministic_algorithms(True)``: operations pick their deterministic kernels; one
  that has none (e.g. ``index_add_`` backward on CUDA, some scatter reductions) raises a
  ``RuntimeError`` naming it instead of silently varying. Deterministic kernels are often slower
  (atomics replaced by sorts or serial reductions).
- cuDNN ``deterministic = True`` and ``benchmark = False``: convolutions use a fixed algorithm
  instead of the fastest one measured for each shape (typically 0-30 % slower convolutions).
- the variables the device type needs (its ``deterministic_env``, unless already set): on CUDA
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, as cuBLAS needs a fixed workspace to be reproducible; it costs
  a few MiB per stream. It must be set before the first cuBLAS call, so create the Session before any
  CUDA matrix multiply.
- seeded DataLoader workers (:func:`seed_worker`): ``random`` and numpy in each worker are seeded
  from the worker's torch seed, which comes from the session's seed; loaders built by
  ``session.build_loader`` also get a generator seeded per rank.

Determinism across different GPUs, drivers, library versions or world sizes is not promised (floating
point sums in another order differ); ddp's gradient all-reduce is deterministic for a fixed world.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import torch

from multigpu.devices import get_device_type
from multigpu.session.coordination import rank_seed


def apply_deterministic(device: torch.device) -> Callable[[], None]:
    """Switch this process to deterministic algorithms (see the module docstring for the costs).

    Returns:
        A function that puts torch's previous settings back (the Session calls it when it closes;
        the cuBLAS variable stays, as cuBLAS has read it).
    """
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )

    def restore() -> None:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]

    for name, value in get_device_type(device).deterministic_env.items():
        os.environ.setdefault(name, value)  # read by the device's libraries (cuBLAS) when they start
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return restore


def seed_worker(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: seed ``random`` and numpy from the worker's torch seed."""
    seed = torch.initial_seed() % 2**32  # torch gave each worker base_seed + worker_id
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional: nothing to seed
        return
    np.random.seed(seed)


_LOADER_SALT = 0x5EED_10AD


def seeded_loader_kwargs(seed: int, rank: int, given: dict[str, object]) -> dict[str, object]:
    """``given`` with a seeded ``worker_init_fn`` and ``generator`` unless the caller passed their own."""
    kwargs = dict(given)
    kwargs.setdefault("worker_init_fn", seed_worker)
    # a seed of its own per (seed, rank): seed + rank made seed 0's rank 1 seed 1's rank 0
    loader_seed = rank_seed(seed, rank) ^ _LOADER_SALT  # not the rank's dropout stream (rank_seed itself)
    kwargs.setdefault("generator", torch.Generator().manual_seed(loader_seed))
    return kwargs
