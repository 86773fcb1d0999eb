"""What ``Session.evaluate`` accepts from its function: one result row per sample of the batch.

``evaluate`` gathers per-sample results by dataset index; a function that returns a list, a
float, a batch mean (a 0-dimensional tensor) or the wrong number of rows would fail deep inside
that gather (``AttributeError: ... 'detach'``, a length mismatch). :func:`per_sample_result`
names the problem and the fix instead.
"""

from __future__ import annotations

from typing import Any

import torch

from multigpu.core.structure import iter_tensors
from multigpu.errors import ConfigError


def _rows(batch: Any) -> int | None:
    """The batch's sample count: dim 0 of its first tensor (None when it holds none)."""
    return next((int(t.shape[0]) for t in iter_tensors(batch) if t.dim()), None)


def per_sample_result(result: Any, batch: Any) -> torch.Tensor:
    """``result`` when it is a tensor of one row per sample of ``batch``; else a ConfigError that says what it is.

    Example:
        >>> per_sample_result(torch.zeros(3), [torch.ones(3, 2)]).shape
        torch.Size([3])
    """
    rows = _rows(batch)
    fix = "evaluate needs one row per sample, e.g. fn=lambda batch: model(batch[0]).argmax(1)"
    if not isinstance(result, torch.Tensor):
        raise ConfigError(f"evaluate's fn returned a {type(result).__name__}, not a tensor; {fix}")
    if result.dim() == 0:
        raise ConfigError(f"evaluate's fn returned a 0-dimensional tensor (one value for the batch); {fix}")
    if rows is not None and result.shape[0] != rows:
        raise ConfigError(f"evaluate's fn returned {result.shape[0]} row(s) for a batch of {rows} samples; {fix}")
    return result
