"""What hardware: device specifications, and one object per device type.

- :mod:`~multigpu.devices.parse`: ``"cpu:2"`` / ``"cuda:0,1"`` / ``[0, 1]`` into replica devices;
- :mod:`~multigpu.devices.base`: the :class:`DeviceType` interface (synchronize, memory statistics,
  RNG state, timing marks, device context, streams, coalesced copies, backend, names);
- one module per type: :mod:`~multigpu.devices.cpu`, :mod:`~multigpu.devices.cuda` (the only
  module of multigpu that calls torch's CUDA module), :mod:`~multigpu.devices.xpu`, :mod:`~multigpu.devices.mps`;
- :mod:`~multigpu.devices.registry`: the types by name, and questions asked of all of them.

Adding a device type is one module with a :class:`DeviceType` subclass, registered here (or, out
of tree, with :func:`register_device_type`).

Example:
    >>> [d.label for d in parse_devices("cpu:2")], get_device_type("cpu").backend
    (['cpu:0', 'cpu:1'], 'gloo')
"""

from __future__ import annotations

from multigpu.devices.base import DeviceCapacity, DeviceEvent, DeviceType, Mark
from multigpu.devices.cpu import CpuDevice
from multigpu.devices.cuda import CudaDevice
from multigpu.devices.mps import MpsDevice
from multigpu.devices.parse import MAX_REPLICAS, DeviceSpec, ReplicaDevice, parse_devices, parse_output_device
from multigpu.devices.registry import (
    accelerator_type,
    backend_device_type,
    capture_device_rng,
    common_type,
    device_count,
    device_type_names,
    get_device_type,
    process_device_type,
    register_device_type,
    replica_device_type,
    restore_device_rng,
    several_accelerators,
    synchronizer,
    unregister_device_type,
)
from multigpu.devices.xpu import XpuDevice

# Registration order is the order accelerators are looked for: CUDA first, as torch does.
for _builtin in (CpuDevice(), CudaDevice(), XpuDevice(), MpsDevice()):
    register_device_type(_builtin)

__all__ = [
    "MAX_REPLICAS",
    "DeviceCapacity",
    "DeviceEvent",
    "DeviceSpec",
    "DeviceType",
    "Mark",
    "ReplicaDevice",
    "accelerator_type",
    "backend_device_type",
    "capture_device_rng",
    "common_type",
    "device_count",
    "device_type_names",
    "get_device_type",
    "parse_devices",
    "parse_output_device",
    "process_device_type",
    "register_device_type",
    "replica_device_type",
    "restore_device_rng",
    "several_accelerators",
    "synchronizer",
    "unregister_device_type",
]
