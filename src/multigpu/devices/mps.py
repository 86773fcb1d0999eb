"""Apple's Metal (MPS) as a device type: one device, one queue, one generator.

``torch.mps`` speaks of a single device: its ``synchronize`` and random state take no index,
and it reports the memory allocated now but no peak, so the allocation tracker measures MPS
replicas as it does CPU ones. ``parse_devices(None)`` does not pick MPS (it stays on the CPU,
as before MPS was supported); ask for it with ``devices="mps"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from multigpu.devices.base import DeviceType


class MpsDevice(DeviceType):
    """The GPU of an Apple-silicon Mac."""

    name = "mps"
    display = "MPS"
    replicas_by_default = False

    def is_available(self) -> bool:
        backend = getattr(torch.backends, "mps", None)
        return bool(backend is not None and backend.is_available())

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def synchronize(self, device: torch.device | None = None) -> None:
        self._call("synchronize")  # one device: torch.mps.synchronize() takes no argument

    def get_rng_state_all(self) -> list[torch.Tensor] | None:
        state = self._call("get_rng_state") if self.is_available() else None
        return None if state is None else [state]

    def set_rng_state_all(self, states: Sequence[torch.Tensor]) -> None:
        if states:
            self._call("set_rng_state", states[0])

    def device_name(self, device: torch.device) -> str:
        return "mps"

    def describe(self, index: int) -> str:
        return "Apple MPS"
