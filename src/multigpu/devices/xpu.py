"""Intel GPUs (XPU) as a device type: torch's generic device module does everything needed.

``torch.xpu`` mirrors the CUDA module's names (synchronize, device, memory statistics, per-device
random state, device names), so the defaults of :class:`~multigpu.devices.base.DeviceType` serve
it unchanged. Processes on XPUs use gloo, as before XPUs were a type of their own; XCCL is a
``backend = "xccl"`` away once it is tested.
"""

from __future__ import annotations

from multigpu.devices.base import DeviceType


class XpuDevice(DeviceType):
    """Intel GPUs."""

    name = "xpu"
    display = "XPU"
    pin_memory = True
    allocator_stats = True  # where this torch's torch.xpu has the statistics (has_allocator_stats checks)
    profiler_activity = "XPU"
    torch_sync_batchnorm = True  # torch's nn.SyncBatchNorm accepts XPU tensors
