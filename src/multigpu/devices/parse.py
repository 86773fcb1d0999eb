"""Parse device specifications into an ordered list of replica devices.

Accepted everywhere a set of devices is asked for:

    "cpu:2"               two replicas on the CPU (each its own "device" in every report)
    "cuda:0,1"            CUDA devices 0 and 1;  "cuda" means every visible CUDA device
    ["cuda:0", "cuda:1"]  a list of strings, ints (accelerator indices) or torch.device
    [0, 1]                accelerator indices, as nn.DataParallel's device_ids
    None                  every visible GPU, else the CPU alone

The first device is the *primary device*: it holds the module's parameters, gathers the
outputs by default and runs the optimizer. At most :data:`MAX_REPLICAS` replicas: each costs a
thread and a copy of the module per step, and beyond a few dozen, processes (DDP) scale better.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from multigpu.core.lookup import lookup
from multigpu.devices.registry import accelerator_type, device_count, device_type_names, replica_device_type
from multigpu.errors import DeviceError

DeviceSpec = str | int | torch.device | Sequence[str | int | torch.device] | None

MAX_REPLICAS = 64  # replicas one process may run: one thread and one module copy each
_SPEC = re.compile(r"^(?P<type>[a-z]+)(?::(?P<rest>[0-9, ]+))?$")


@dataclass(frozen=True)
class ReplicaDevice:
    """One replica's place: the torch device it computes on and the name reports use.

    Several CPU replicas share ``torch.device("cpu")``; their labels ``cpu:0``, ``cpu:1``
    keep them apart in tables and figures.
    """

    device: torch.device
    label: str

    @property
    def type(self) -> str:
        return self.device.type

    def __str__(self) -> str:
        return self.label


def parse_devices(spec: DeviceSpec = None) -> list[ReplicaDevice]:
    """Turn any accepted device specification into the ordered list of replica devices.

    Args:
        spec: see the module docstring for every accepted form.

    Returns:
        One :class:`ReplicaDevice` per replica; the first is the primary device.

    Raises:
        DeviceError: the specification does not parse or names a device that is not there.

    Example:
        >>> [str(d) for d in parse_devices("cpu:2")]
        ['cpu:0', 'cpu:1']
    """
    if spec is None:
        kind = replica_device_type()
        if kind.name != "cpu":
            return _indexed(kind.name, list(range(kind.device_count())), spec)
        return [ReplicaDevice(torch.device("cpu"), "cpu")]
    if isinstance(spec, str):
        return _parse_string(spec)
    if isinstance(spec, (int, torch.device)) and not isinstance(spec, bool):
        return parse_devices([spec])
    if isinstance(spec, Sequence) and not isinstance(spec, (bytes, bytearray)):
        if len(spec) == 0:
            raise DeviceError("devices=[] names no device; pass e.g. devices='cpu:2' or device_ids=[0, 1]")
        _check_count(len(spec), spec)
        return _parse_list(list(spec))
    raise DeviceError(f"devices={spec!r} is not a device specification; use e.g. 'cpu:2', 'cuda:0,1' or [0, 1]")


def _parse_string(spec: str) -> list[ReplicaDevice]:
    match = _SPEC.match(spec.strip().lower())
    if match is None:
        raise DeviceError(
            f"device string {spec!r} does not parse; use 'cpu', 'cpu:2' (two CPU replicas), "
            "'cuda', 'cuda:0,1' or a list such as ['cuda:0', 'cuda:1']"
        )
    device_type, rest = match["type"], match["rest"]
    message = "device string {spec!r} does not parse: {value!r} is not one of {choices}; use e.g. 'cpu:2' or 'cuda:0,1'"
    lookup(dict.fromkeys(device_type_names()), device_type, message, error=DeviceError, spec=spec)
    if device_type == "cpu":
        count = int(rest) if rest and "," not in rest else (1 if not rest else 0)
        if count < 1:
            raise DeviceError(f"device string {spec!r}: 'cpu:N' takes a replica count N >= 1, e.g. 'cpu:2'")
        _check_count(count, spec)
        return _cpu_replicas(count)
    if rest is None:
        return _indexed(device_type, list(range(device_count(device_type))), spec)
    indices = [int(part) for part in rest.split(",") if part.strip()]
    return _indexed(device_type, indices, spec)


def _parse_list(items: list[str | int | torch.device]) -> list[ReplicaDevice]:
    out: list[ReplicaDevice] = []
    cpu_count = 0
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str, torch.device)):
            raise DeviceError(
                f"devices={items!r} holds {item!r} ({type(item).__name__}); each entry must be an accelerator "
                "index (0), a device string ('cuda:1', 'cpu') or a torch.device"
            )
        if isinstance(item, int):
            accel = accelerator_type()
            if accel is None:
                raise DeviceError(
                    f"device index {item} names an accelerator, but none is visible to this process; "
                    f"use devices='cpu:{len(items)}' for {len(items)} replicas on the CPU"
                )
            out.extend(_indexed(accel, [item], items))
            continue
        device = item if isinstance(item, torch.device) else _to_device(item)
        if device.type == "cpu":
            out.append(ReplicaDevice(torch.device("cpu"), f"cpu:{cpu_count}"))
            cpu_count += 1
        else:
            out.extend(_indexed(device.type, [device.index or 0], items))
    if cpu_count == 1 and len(out) == 1:
        return [ReplicaDevice(torch.device("cpu"), "cpu")]
    _refuse_repeats([d.device for d in out if d.type != "cpu"], items)
    return out


def _to_device(text: str) -> torch.device:
    try:
        return torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise DeviceError(f"device {text!r} does not parse ({exc}); use e.g. 'cuda:0' or 'cpu'") from exc


def parse_output_device(spec: int | str | torch.device | None, primary: torch.device) -> torch.device:
    """Where outputs are gathered, read as nn.DataParallel reads ``output_device``, on any device.

    Args:
        spec: None (the primary device), an accelerator index (``-1`` is the CPU, as torch
            documents), a device string (``"cuda:1"``, ``"cpu"``) or a ``torch.device``.
        primary: the primary device.

    Returns:
        The torch device; every CPU form is ``torch.device("cpu")``.

    Raises:
        DeviceError: a value of another type, a string that does not parse, or a device that is not there.

    Example:
        >>> parse_output_device(-1, torch.device("cpu"))
        device(type='cpu')
    """
    if spec is None:
        return primary
    if isinstance(spec, bool) or not isinstance(spec, (int, str, torch.device)):
        raise DeviceError(
            f"output_device={spec!r} ({type(spec).__name__}) is not a device; pass an accelerator index "
            "(0, or -1 for the CPU), a device string ('cuda:1', 'cpu') or a torch.device"
        )
    if isinstance(spec, int):
        if spec == -1:
            return torch.device("cpu")
        accel = accelerator_type()
        if accel is None or spec < -1:
            raise DeviceError(
                f"output_device={spec} names an accelerator index, but "
                + ("none is visible to this process" if accel is None else "indices start at 0")
                + "; use output_device='cpu' (or -1) for the CPU"
            )
        return _indexed(accel, [spec], spec, what="output_device")[0].device
    device = spec if isinstance(spec, torch.device) else _to_device(spec)
    if device.type == "cpu":
        return torch.device("cpu")
    message = "output_device={spec!r}: {value!r} is not one of {choices}; register the type or pick a device of one"
    lookup(dict.fromkeys(device_type_names()), device.type, message, error=DeviceError, spec=spec)
    index = device.index if device.index is not None else 0
    return _indexed(device.type, [index], spec, what="output_device")[0].device


def _check_count(count: int, spec: object) -> None:
    if count > MAX_REPLICAS:
        shown = spec if isinstance(spec, str) else f"a list of {count} devices"
        raise DeviceError(
            f"devices={shown!r} asks for {count} replicas; one process runs at most {MAX_REPLICAS} "
            f"(multigpu.devices.MAX_REPLICAS); use fewer, e.g. devices='cpu:4', or processes: "
            "multigpu launch --strategy ddp"
        )


def _cpu_replicas(count: int) -> list[ReplicaDevice]:
    if count == 1:
        return [ReplicaDevice(torch.device("cpu"), "cpu")]
    return [ReplicaDevice(torch.device("cpu"), f"cpu:{i}") for i in range(count)]


def _indexed(device_type: str, indices: list[int], spec: object, what: str = "devices") -> list[ReplicaDevice]:
    available = device_count(device_type)
    if not indices:
        raise DeviceError(
            f"devices={spec!r} found no visible {device_type} device; use devices='cpu:2' to run replicas on the CPU"
        )
    for index in indices:
        if index < 0 or index >= available:
            raise DeviceError(
                f"{device_type}:{index} (from {what}={spec!r}) does not exist: this process sees "
                f"{available} {device_type} device(s); pick indices below {available} "
                "or use devices='cpu:2' to run on the CPU"
            )
    _refuse_repeats([torch.device(device_type, i) for i in indices], spec)
    return [ReplicaDevice(torch.device(device_type, i), f"{device_type}:{i}") for i in indices]


def _refuse_repeats(devices: list[torch.device], spec: object) -> None:
    """One replica per accelerator: two would share its queue and memory for no gain (CPU replicas may share)."""
    twice = next((d for i, d in enumerate(devices) if d in devices[:i]), None)
    if twice is not None:
        raise DeviceError(
            f"devices={spec!r} names {twice} twice; list each {twice.type} device once "
            "(one replica per accelerator; several replicas share only the CPU, e.g. devices='cpu:2')"
        )
