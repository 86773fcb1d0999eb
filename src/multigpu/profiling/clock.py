"""Time marks on the host or on a CUDA stream, resolved to seconds only when a report needs them.

A *mark* is ``time.perf_counter()`` for host devices and a recorded ``torch.cuda.Event`` for a CUDA
device, so marking never synchronises: the GPU keeps running ahead and the events are read once,
when the profile is summarised (:func:`seconds_between` on CUDA marks is the sync point).
"""

from __future__ import annotations

import time

import torch

Mark = float | torch.cuda.Event


def cuda_device(label: str | None) -> torch.device | None:
    """The CUDA device a report label names (``"cuda:1"``), or None for host devices."""
    if label is None or not label.startswith("cuda"):
        return None
    return torch.device(label)


def mark(device: torch.device | None = None) -> Mark:
    """Now, on the host (``device`` None) or on ``device``'s current CUDA stream."""
    if device is None:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def seconds_between(start: Mark, end: Mark) -> float:
    """Seconds from ``start`` to ``end`` (both host marks, or both events of one device)."""
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
        end.synchronize()  # sync point: only when the profile is summarised
        return start.elapsed_time(end) / 1e3
    raise TypeError(f"cannot time from {type(start).__name__} to {type(end).__name__}: mix of host and CUDA marks")
