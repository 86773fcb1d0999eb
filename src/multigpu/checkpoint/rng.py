"""The random state of one process (python, numpy, torch CPU, each accelerator), as plain data.

Captured as tensors, ints and tuples only, so a checkpoint holding it loads with
``torch.load(weights_only=True)``. Each rank has its own state (dropout masks differ per rank);
:mod:`state` gathers every rank's on the main process and gives each rank its own back.
The accelerators' generators are read and set by their device objects
(:func:`multigpu.devices.capture_device_rng`), one entry per type name (``"cuda"``: a state per
CUDA device), so a checkpoint written before there were device objects restores unchanged.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from multigpu.devices import capture_device_rng, device_type_names, restore_device_rng


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
    state.update(capture_device_rng())  # {"cuda": [state of cuda:0, ...]} where CUDA is available
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put this process's random generators back to ``state`` (from :func:`capture_rng`).

    An accelerator's states are restored only where as many devices of its type are visible as
    when they were saved (a run resumed on other hardware keeps its fresh generators).
    """
    random.setstate(_as_python_state(state["python"]))
    saved = state["numpy"]
    keys = saved["keys"].numpy().astype(np.uint32)
    np.random.set_state((saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    restore_device_rng({name: state[name] for name in device_rng_keys() if name in state})


def device_rng_keys() -> tuple[str, ...]:
    """The entries of a random state that may hold accelerators' generators: the registered types but the CPU.

    Example:
        >>> "cuda" in device_rng_keys(), "cpu" in device_rng_keys()
        (True, False)
    """
    return tuple(name for name in device_type_names() if name != "cpu")


def _as_python_state(saved: Any) -> tuple[Any, ...]:
    # random.setstate wants tuples; a round trip through some serializers turns them into lists.
    version, internal, gauss = saved
    return (int(version), tuple(int(x) for x in internal), gauss)
