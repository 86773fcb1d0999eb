"""The random state of one process (python, numpy, torch CPU, CUDA), as plain data.

Captured as tensors, ints and tuples only, so a checkpoint holding it loads with
``torch.load(weights_only=True)``. Each rank has its own state (dropout masks differ per rank);
:mod:`state` gathers every rank's on the main process and gives each rank its own back.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """The random state of this process.

    Example:
        >>> state = capture_rng(); a = torch.rand(1); restore_rng(state); bool(torch.rand(1) == a)
        True
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put this process's random generators back to ``state`` (from :func:`capture_rng`).

    A CUDA state is restored only where as many CUDA devices are visible as when it was saved.
    """
    random.setstate(_as_python_state(state["python"]))
    saved = state["numpy"]
    keys = saved["keys"].numpy().astype(np.uint32)
    np.random.set_state((saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _as_python_state(saved: Any) -> tuple[Any, ...]:
    # random.setstate wants tuples; a round trip through some serializers turns them into lists.
    version, internal, gauss = saved
    return (int(version), tuple(int(x) for x in internal), gauss)
