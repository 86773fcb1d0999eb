"""How much memory a file's tensors take once made contiguous, against the bytes the file holds.

A tensor in a torch file is a view of a storage: shape ``[10**12]`` with stride 0 over a
4-byte storage is a few bytes on disk and 4 TB once copied (safetensors writes every tensor
contiguous). Loading into a model is bounded by the model itself (shapes must match), but
converting a file is not; :func:`check_expansion` refuses a file that would grow by more than
a stated factor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch

from multigpu.errors import CheckpointError

DEFAULT_MAX_EXPANSION = 4.0  # contiguous bytes per byte on disk, for `ckpt convert`
_SLACK = 1 << 20  # small files (headers, empty tensors) may expand by up to 1 MiB regardless


def materialized_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` once contiguous (no allocation)."""
    return tensor.numel() * tensor.element_size()


def check_expansion(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str], *, max_expansion: float) -> None:
    """Refuse ``tensors`` (read from ``path``) if, made contiguous, they exceed ``max_expansion`` x the file.

    Views of one storage with the same layout (tied weights) count once.

    Raises:
        CheckpointError: naming the largest tensor, the sizes, and how to allow it.

    Example:
        >>> import tempfile; from pathlib import Path
        >>> p = Path(tempfile.mkdtemp()) / "w.pt"; torch.save({"w": torch.zeros(4)}, p)
        >>> check_expansion({"w": torch.zeros(4)}, p, max_expansion=4.0)
    """
    if math.isinf(max_expansion):
        return
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    total, largest, largest_key = 0, 0, ""
    for key, tensor in tensors.items():
        ident = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tensor.stride(),
        )
        if ident in seen and tensor.numel():
            continue
        seen.add(ident)
        size = materialized_bytes(tensor)
        total += size
        if size > largest:
            largest, largest_key = size, key
    check_total(path, os.path.getsize(path), total, (largest_key, largest), max_expansion=max_expansion)


def check_total(
    path: str | os.PathLike[str], on_disk: int, total: int, largest: tuple[str, int], *, max_expansion: float
) -> None:
    """Refuse tensors of ``total`` bytes read from ``on_disk`` bytes at ``path`` beyond ``max_expansion``.

    Raises:
        CheckpointError: naming the largest tensor (``(key, bytes)``), the sizes, and how to allow it.
    """
    if total > max_expansion * on_disk + _SLACK:
        raise CheckpointError(
            f"{str(path)!r} holds {on_disk} bytes but its tensors take {total} bytes once contiguous "
            f"({total / max(on_disk, 1):.3g}x, above the limit of {max_expansion:g}x; largest: {largest[0]!r}, "
            f"{largest[1]} bytes, a strided or expanded view). If you expect this, raise the limit "
            "(CLI: --max-expansion FACTOR, or inf)."
        )
