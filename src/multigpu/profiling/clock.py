"""Time marks on the host or on a device, resolved to seconds only when a report needs them.

A *mark* is what the device type's :meth:`~multigpu.devices.DeviceType.mark` gives: the host
clock (``time.perf_counter()``) for host devices and for accelerators without events (after a
synchronize), an event recorded on the device's current stream where the type times with events
(CUDA). Event marks never synchronise: the device keeps running ahead and the events are read
once, when the profile is summarised (:func:`seconds_between` on event marks is the sync point).
"""

from __future__ import annotations

import time

import torch

from multigpu.devices import Mark, get_device_type

__all__ = ["Mark", "device_of", "mark", "seconds_between"]


def device_of(label: str | None) -> torch.device | None:
    """The device a report label names when it is timed on the device (``"cuda:1"``); None for host devices.

    CPU replicas (``"cpu:1"``) and labels of no registered device type are timed on the host clock.
    """
    if label is None:
        return None
    kind = label.split(":", 1)[0]
    if kind == "cpu":
        return None
    try:
        get_device_type(kind)
        return torch.device(label)
    except (RuntimeError, ValueError, LookupError):
        return None


def mark(device: torch.device | None = None) -> Mark:
    """Now, on the host (``device`` None) or as ``device``'s type marks time on it."""
    if device is None:
        return time.perf_counter()
    return get_device_type(device.type).mark(device)


def seconds_between(start: Mark, end: Mark) -> float:
    """Seconds from ``start`` to ``end`` (both host marks, or both events of one device)."""
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    if not isinstance(start, float) and not isinstance(end, float):
        end.synchronize()  # sync point: only when the profile is summarised
        return start.elapsed_time(end) / 1e3
    raise TypeError(f"cannot time from {type(start).__name__} to {type(end).__name__}: mix of host and device marks")
