"""A whole device type in one class ("meta", two devices); the ``meta`` fixture (tests/conftest.py) registers it.

Tests of the device registry and of what asks it (the engine, checkpoints' random state) use it
as a new accelerator would be added: one object, no torch.cuda.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import torch

from multigpu.devices import DeviceCapacity, DeviceType, Mark


class MetaDevice(DeviceType):
    """Two "meta" devices: a whole device type in one class, as a new accelerator would be."""

    name = "meta"
    display = "META"
    backend = "fakebackend"

    def __init__(self) -> None:
        self.synced: list[torch.device | None] = []
        self.rng = [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)]
        self.current = threading.local()  # like CUDA's current device: one per thread

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def synchronize(self, device: torch.device | None = None) -> None:
        self.synced.append(device)

    def mark(self, device: torch.device) -> Mark:
        self.synchronize(device)
        return time.perf_counter()

    def device_context(self, device: torch.device):  # type: ignore[no-untyped-def]
        import contextlib

        @contextlib.contextmanager
        def entered() -> Iterator[None]:
            previous = getattr(self.current, "index", None)
            self.current.index = device.index
            try:
                yield
            finally:
                self.current.index = previous

        return entered()

    def current_device(self) -> torch.device:
        return torch.device("meta", getattr(self.current, "index", None) or 0)

    def current_stream(self, device: torch.device) -> tuple[str, int]:
        # like CUDA's current streams: one per device and per thread, the default one until set
        return getattr(self.current, "streams", {}).get(device.index, ("default", device.index))

    def stream_context(self, stream: tuple[str, int] | None):  # type: ignore[no-untyped-def]
        import contextlib

        @contextlib.contextmanager
        def entered() -> Iterator[None]:
            saved = dict(getattr(self.current, "streams", {}))
            if stream is not None:
                self.current.streams = {**saved, stream[1]: stream}
            try:
                yield
            finally:
                self.current.streams = saved

        return entered()

    def get_rng_state_all(self) -> list[torch.Tensor] | None:
        return [t.clone() for t in self.rng]

    def set_rng_state_all(self, states: Sequence[torch.Tensor]) -> None:
        self.rng = [t.clone() for t in states]

    def capacity(self, device: torch.device) -> DeviceCapacity | None:
        return DeviceCapacity(memory=(device.index + 1) * 2**30, cores=8)  # meta:1 has twice meta:0's memory
