"""``multigpu profile``'s throughput and MFU: the figures ``session.log`` adds, for a script profiled as it is.

The script is not a Session's, so the figures are read from what it runs: its outermost module calls on
the thread that runs it (a DataParallel's own replica threads are inside one) give each step's samples
(the first dimension of the call's first tensor) and the model; the first such model is copied to the
meta device and its FLOPs per sample counted as :mod:`multigpu.session.throughput` does, against the peak
of the devices the profile saw (in the dtype of the model's parameters: a step under bf16 autocast is
counted against the fp32 peak).

Example::

    with ScriptWatch() as watch, profile_steps(on_step=watch.on_step) as profiler:
        run_as_main(script, args)
    figures = watch.figures(profiler.profile())
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from multigpu.core.keys import unwrap
from multigpu.profiling.bandwidth import replica_devices_from_labels
from multigpu.profiling.records import StepProfile
from multigpu.session.throughput import FirstForward, batch_size, peak_of_run


class ScriptWatch:
    """Samples per kept step and the model, from the script's outermost module calls (see the module docstring)."""

    def __init__(self) -> None:
        self.samples = 0  # over the kept steps
        self.model: FirstForward | None = None
        self._since_step = 0
        self._kept = 0
        self._depth = 0
        self._device: torch.device | None = None
        self._dtype = torch.float32
        self._thread = threading.current_thread()
        self._handles: list[Any] = []

    def __enter__(self) -> ScriptWatch:
        self._handles = [
            register_module_forward_pre_hook(self._before),
            register_module_forward_hook(self._after, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        if self.model is not None:
            self.model.release()

    def _before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if threading.current_thread() is not self._thread:
            return
        self._depth += 1
        if self._depth > 1:
            return
        self._since_step += batch_size(args)
        if self.model is None:  # the first model: its next forward is captured (this one has begun)
            bare = unwrap(module)
            first = next(bare.parameters(), None)
            if first is not None:
                self._device, self._dtype = first.device, first.dtype
                self.model = FirstForward(bare)

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if threading.current_thread() is self._thread:
            self._depth = max(0, self._depth - 1)

    def on_step(self, kept: int) -> None:
        """After each optimizer step (the profiler's ``on_step``): a kept step takes the samples since the last."""
        if kept > self._kept:
            self.samples += self._since_step
            self._kept = kept
        self._since_step = 0

    def figures(self, profile: StepProfile) -> dict[str, float]:
        """``step_time_s`` (median), ``samples_per_s`` and ``mfu`` of the kept steps (those known)."""
        seconds = sum(step.wall_s for step in profile.steps)
        out = {"step_time_s": profile.median_step_s()}
        if not self.samples or seconds <= 0:
            return out
        out["samples_per_s"] = self.samples / seconds
        if self.model is None or self._device is None:
            return out
        try:
            flops = self.model.flops_per_sample()
        except Exception:  # whatever the meta copy cannot run: no mfu, the profile stands
            return out
        devices = len({r.device for r in replica_devices_from_labels(profile.devices)}) or 1
        out["mfu"] = flops * out["samples_per_s"] / peak_of_run(self._device, self._dtype, devices)
        return out
