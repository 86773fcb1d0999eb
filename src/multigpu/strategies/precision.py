"""Numeric precision of a training step, as small objects chosen by name: fp32, bf16, fp16.

Each precision owns four moments of a step: the forward's autocast region, the loss scaling
before backward, unscaling the gradients (before clipping them) and the optimizer step. ``fp16``
needs a gradient scaler (small float16 gradients underflow to zero); ``bf16`` has float32's
range and does not.

Example:
    >>> precision = build_precision("bf16", "cpu")
    >>> with precision.autocast():
    ...     y = torch.nn.Linear(4, 2)(torch.randn(3, 4))
    >>> y.dtype
    torch.bfloat16
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch

from multigpu.core.lookup import lookup


class Precision:
    """Full float32: no autocast, no scaling. The base of the other precisions."""

    name: ClassVar[str] = "fp32"

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def autocast(self) -> AbstractContextManager[Any]:
        """The region the forward pass (and loss) runs in."""
        return nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call ``backward`` on."""
        return loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring ``optimizer``'s gradients to their true values (before clipping or rescaling them)."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply the accumulated gradients; returns whether the parameters were updated."""
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep to resume this precision exactly (the scaler's state)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


class BF16(Precision):
    """Autocast to bfloat16: float32's exponent range, so no loss scaling."""

    name: ClassVar[str] = "bf16"

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=torch.bfloat16)


class FP16(Precision):
    """Autocast to float16 with a gradient scaler (skips steps whose gradients overflowed)."""

    name: ClassVar[str] = "fp16"

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type)
        self.scaler = torch.amp.GradScaler(device_type)

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=torch.float16)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)  # at most once per step; the scaler's step then skips it

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)  # unscales unless done; skips the step on inf/nan gradients
        self.scaler.update()  # lowers the scale exactly when it skipped
        return self.scaler.get_scale() >= scale

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["scaler"])


PRECISIONS: dict[str, type[Precision]] = {cls.name: cls for cls in (Precision, BF16, FP16)}


def build_precision(name: str, device_type: str) -> Precision:
    """The precision object called ``name`` for computation on ``device_type``.

    Raises:
        ConfigError: ``name`` is not a known precision.
    """
    message = "precision={value!r} is not one of {choices}; use e.g. precision='bf16'"
    return lookup(PRECISIONS, name, message, choices=sorted(PRECISIONS))(device_type)
