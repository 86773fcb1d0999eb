"""The device types multigpu knows, by name, and the questions asked of all of them at once.

Built-in types (cpu, cuda, xpu, mps) are registered when :mod:`multigpu.devices` is imported;
:func:`register_device_type` adds another (an out-of-tree accelerator, or a test's own type)
without touching any other module. Registration order is the order accelerators are looked for
(:func:`accelerator_type`): the first available one wins. That is the one device rule
(``_first_available``), asked three ways: any accelerator (:func:`accelerator_type`), the type dp's
replicas use (:func:`replica_device_type`), the type a worker process of ddp/fsdp computes on
(:func:`process_device_type`; the runtime, the launcher, the Session's ``auto`` and the CLI ask it).
How many devices a run takes by default is the type's own answer (``DeviceType.default_replicas``).

Example:
    >>> get_device_type("cuda").backend
    'nccl'
    >>> accelerator_type() is None or accelerator_type() in device_type_names()
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from multigpu.core.lookup import lookup
from multigpu.devices.base import DeviceType
from multigpu.errors import ConfigError, DeviceError

_TYPES: dict[str, DeviceType] = {}  # the registry itself: name -> the one object of that type


def register_device_type(device_type: DeviceType) -> DeviceType:
    """Make ``device_type`` known under ``device_type.name``; returns it.

    Raises:
        ConfigError: a type of that name is registered already (unregister it first).
    """
    name = device_type.name
    if name in _TYPES:
        raise ConfigError(
            f"device type {name!r} is registered already ({type(_TYPES[name]).__name__}); "
            f"call unregister_device_type({name!r}) first to replace it"
        )
    _TYPES[name] = device_type
    return device_type


def unregister_device_type(name: str) -> None:
    """Forget the type ``name`` (no-op when unknown); the CPU stays, everything depends on it."""
    if name == "cpu":
        raise ConfigError("the cpu device type cannot be unregistered: it is every run's fallback")
    _TYPES.pop(name, None)


def device_type_names() -> tuple[str, ...]:
    """Every registered type name, in registration order (``('cpu', 'cuda', 'xpu', 'mps')``)."""
    return tuple(_TYPES)


def get_device_type(device: str | torch.device) -> DeviceType:
    """The object of a device type, by name (``"cuda"``) or by a device of that type.

    Raises:
        DeviceError: no such type is registered, naming the ones that are.
    """
    name = device.type if isinstance(device, torch.device) else device
    return lookup(
        _TYPES,
        name,
        "device type {value!r} is not one of {choices}; use e.g. 'cpu:2' or 'cuda:0,1' "
        "(or register the type: multigpu.devices.register_device_type)",
        error=DeviceError,
    )


def _first_available(serves: Callable[[DeviceType], bool]) -> DeviceType:
    """The one device rule: the first registered accelerator type that is available and ``serves``; else the CPU.

    Registration order decides between several (CUDA first, as torch looks). Every default device
    below is this rule with a different question.
    """
    cpu = _TYPES["cpu"]
    found = (t for name, t in _TYPES.items() if name != "cpu" and serves(t) and t.is_available())
    return next(found, cpu)


def accelerator_type() -> str | None:
    """The accelerator type visible to this process (``"cuda"``, ``"xpu"``, ``"mps"``), or None.

    The first registered non-CPU type that is available. (``torch.accelerator``, torch 2.6+,
    answers the same question, but only for types torch itself knows and not on torch 2.4/2.5.)
    """
    found = _first_available(lambda t: True)
    return None if found.name == "cpu" else found.name


def replica_device_type() -> DeviceType:
    """The device type dp's replicas (threads of one process) use by default: the first available type
    that takes its replicas by default (``replicas_by_default``: not MPS), else the CPU.

    Example:
        >>> replica_device_type().name in device_type_names()  # its default_devices(): 'cpu:2' on a CPU
        True
    """
    return _first_available(lambda t: t.replicas_by_default)


def process_device_type() -> DeviceType:
    """The device type a worker process (one per device, as under ddp and fsdp) computes on.

    The first registered type that is available and has a collective backend of its own (CUDA:
    nccl); else the CPU, whose backend is gloo. A type whose processes would use the CPU's backend
    (xpu and mps, today) leaves the workers on the CPU.

    Example:
        >>> process_device_type().backend in ("gloo", "nccl")
        True
    """
    return _first_available(lambda t: t.backend != _TYPES["cpu"].backend)


def several_accelerators() -> DeviceType | None:
    """The accelerator type a run spreads over by default because this process sees several of its
    devices (the workers' type: two GPUs), or None (one GPU, or none: the CPU's replicas serve).

    ``Session(strategy="auto")`` picks dp then; ``multigpu demo`` trains on them.

    Example:
        >>> several_accelerators() is None or several_accelerators().default_replicas() > 1
        True
    """
    kind = process_device_type()
    return kind if kind.name != "cpu" and kind.default_replicas() > 1 else None


def device_count(device_type: str) -> int:
    """How many devices of ``device_type`` this process can see (0 for an unknown type; 1 for cpu)."""
    found = _TYPES.get(device_type)
    return found.device_count() if found is not None else 0


def backend_device_type(backend: str) -> DeviceType | None:
    """The device type whose processes use collective ``backend`` (``"nccl"``: cuda); None for the CPU's (gloo).

    Example:
        >>> backend_device_type("gloo") is None, backend_device_type("nccl").name
        (True, 'cuda')
    """
    if backend == _TYPES["cpu"].backend:
        return None  # gloo collectives run on CPU tensors, whatever the process computes on
    return next((t for name, t in _TYPES.items() if name != "cpu" and t.backend == backend), None)


def common_type(devices: Sequence[torch.device]) -> DeviceType | None:
    """The type of ``devices`` when they all share one (for its fast paths), else None."""
    kinds = {d.type for d in devices}
    return _TYPES.get(kinds.pop()) if len(kinds) == 1 else None


def synchronizer(devices: Sequence[torch.device]) -> Callable[[], None]:
    """A function that waits for the work queued on every device in ``devices`` (a sync point).

    On the CPU it does nothing; on an accelerator it synchronizes each distinct device once,
    so times taken after it include that work. Devices of a type nobody registered (``meta``)
    have nothing to wait for that multigpu knows of and are skipped.

    Example:
        >>> synchronizer([torch.device("cpu")])()
    """
    distinct = [(_TYPES[d.type], d) for d in dict.fromkeys(devices) if d.type != "cpu" and d.type in _TYPES]
    if not distinct:
        return lambda: None

    def sync() -> None:
        for device_type, device in distinct:
            device_type.synchronize(device)

    return sync


def capture_device_rng() -> dict[str, list[torch.Tensor]]:
    """The random state of every device of every available accelerator type, by type name.

    The CPU is not in it (its state is ``torch.get_rng_state()``).

    Example:
        >>> states = capture_device_rng()   # {"cuda": [state of cuda:0, ...]} on a CUDA machine
        >>> restore_device_rng(states)
    """
    states: dict[str, list[torch.Tensor]] = {}
    for name, device_type in _TYPES.items():
        found = device_type.get_rng_state_all() if name != "cpu" and device_type.is_available() else None
        if found is not None:
            states[name] = found
    return states


def restore_device_rng(states: Mapping[str, Sequence[torch.Tensor]]) -> list[str]:
    """Put back states from :func:`capture_device_rng`; returns the types restored.

    A type's states are restored only where it is available with as many devices as were
    captured (a run resumed on other hardware keeps its fresh generators).
    """
    restored = []
    for name, saved in states.items():
        device_type = _TYPES.get(name)
        if device_type is None or not device_type.is_available() or device_type.device_count() != len(saved):
            continue
        device_type.set_rng_state_all(saved)
        restored.append(name)
    return restored
