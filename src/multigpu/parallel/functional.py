"""torch.nn.parallel's functional primitives, with its signatures, on any device.

Code written against ``torch.nn.parallel.scatter / gather / replicate / parallel_apply /
data_parallel`` moves over by changing the import; the devices may be CPU replicas too
(``["cpu", "cpu"]`` or ``"cpu:2"``), where torch's primitives need CUDA.

    from multigpu.parallel import gather, parallel_apply, replicate, scatter

    inputs = scatter(x, ["cpu", "cpu"])                   # torch.chunk's split: 64 -> 32 + 32
    replicas = replicate(model, ["cpu", "cpu"])
    outputs = parallel_apply(replicas, inputs, devices=["cpu", "cpu"])
    y = gather(outputs, "cpu")

    y = multigpu.data_parallel(model, x, devices="cpu:2")  # the same, in one call

Where a device list is asked for, every form :func:`multigpu.parse_devices` accepts works;
integers are accelerator indices, as in torch. Where the two differ, this module follows torch:
the chunk sizes of ``scatter`` are ``torch.chunk``'s (5 samples on 4 devices: 2, 2, 1), 0-dim
outputs are gathered into a vector. Unlike torch, tensors that disagree on the batch size are an
error, not silently truncated, and dataclass outputs keep their type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from multigpu.core.structure import flatten
from multigpu.devices import ReplicaDevice, parse_devices, parse_output_device
from multigpu.errors import ConfigError
from multigpu.parallel.data_parallel import DataParallel
from multigpu.parallel.replicas import build_replicas
from multigpu.parallel.scatter_gather import batch_size, merge_outputs, split_inputs
from multigpu.parallel.threads import ReplicaThreads, run_replicas

Devices = str | Sequence[int | str | torch.device]


def scatter(inputs: Any, target_gpus: Devices, dim: int = 0) -> list[Any]:
    """Split ``inputs`` into chunks, one per device, as ``torch.nn.parallel.scatter`` does.

    Args:
        inputs: a tensor or any nesting of tuples, lists, dicts, namedtuples and dataclasses.
        target_gpus: the devices (``[0, 1]``, ``["cpu", "cpu"]``, ``"cpu:2"``).
        dim: the dimension to split (negative: counted from each tensor's last).

    Returns:
        One structure per chunk, its tensors on that chunk's device; ``torch.chunk`` sizes, so a
        batch smaller than the device count gives fewer chunks. Non-tensors are shared.

    Example:
        >>> [c.shape[0] for c in scatter(torch.zeros(5, 2), "cpu:4")]
        [2, 2, 1]
    """
    devices = parse_devices(target_gpus)
    flat = flatten(inputs)
    batch = batch_size(flat, dim)
    if batch is None:
        return [inputs for _ in devices]
    step = -(-batch // len(devices))  # torch.chunk: equal chunks of ceil(batch / n), the last smaller
    sizes = [min(step, batch - start) for start in range(0, batch, step)]
    return [flat.rebuild(row) for row in split_inputs(flat, sizes, devices[: len(sizes)], dim)]


def gather(outputs: Sequence[Any], target_device: int | str | torch.device, dim: int = 0) -> Any:
    """Concatenate per-replica outputs on ``target_device``, as ``torch.nn.parallel.gather`` does.

    Args:
        outputs: one output structure per replica.
        target_device: an accelerator index (``-1``: the CPU), a device string or torch.device.
        dim: the dimension to concatenate on.

    Returns:
        The outputs' structure with tensors concatenated; 0-dim tensors become a vector.

    Example:
        >>> gather([torch.ones(2, 3), torch.zeros(1, 3)], "cpu").shape
        torch.Size([3, 3])
    """
    device = parse_output_device(target_device, torch.device("cpu"))
    return merge_outputs([flatten(out) for out in outputs], [1] * len(outputs), device, dim, "stack")


def replicate(network: nn.Module, devices: Devices, detach: bool = False) -> list[nn.Module]:
    """One copy of ``network`` per device, as ``torch.nn.parallel.replicate`` does.

    Args:
        network: the module, its parameters on the first device.
        devices: the devices (the same device may repeat: ``["cpu", "cpu"]``).
        detach: ``False``: the copies are differentiable (gradients flow back to ``network``'s
            parameters); ``True``: detached copies that do not require grad (inference).

    Returns:
        The replicas, in device order; the first shares ``network``'s buffers.
    """
    targets = [d.device for d in parse_devices(devices)]
    replicas = build_replicas(network, targets, detach=detach)
    if detach:
        for row in replicas.leaves:
            for leaf in row:
                leaf.requires_grad_(False)
    return replicas.modules


def parallel_apply(
    modules: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Devices | Sequence[None] | None = None,
) -> list[Any]:
    """Call ``modules[i](*inputs[i], **kwargs_tup[i])`` for every i in parallel threads.

    As ``torch.nn.parallel.parallel_apply``: an element of ``inputs`` that is not a tuple or list
    is the module's only argument; grad mode and autocast reach every thread. ``devices`` None:
    each module's device (its first parameter's, else the CPU).

    Returns:
        The outputs, in order.

    Raises:
        ConfigError: lengths that differ. A module's exception is re-raised naming its index.
    """
    if len(inputs) != len(modules) or (kwargs_tup is not None and len(kwargs_tup) != len(modules)):
        raise ConfigError(
            f"parallel_apply got {len(modules)} modules, {len(inputs)} inputs"
            + ("" if kwargs_tup is None else f" and {len(kwargs_tup)} kwargs")
            + "; give one of each per module"
        )
    replica_devices = _apply_devices(modules, devices)
    kwargs = list(kwargs_tup) if kwargs_tup is not None else [{} for _ in modules]
    args = [x if isinstance(x, (list, tuple)) else (x,) for x in inputs]
    if not modules:
        return []
    threads = ReplicaThreads()
    try:
        return run_replicas(lambda i: modules[i](*args[i], **kwargs[i]), replica_devices, threads)
    finally:
        threads.close()


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[int | str | torch.device] | None = None,
    output_device: int | str | torch.device | None = None,
    dim: int = 0,
    module_kwargs: dict[str, Any] | None = None,
    *,
    devices: Devices | None = None,
) -> Any:
    """Evaluate ``module(*inputs, **module_kwargs)`` split across devices, as
    ``torch.nn.parallel.data_parallel`` does: scatter, replicate, parallel_apply, gather.

    Args:
        module: the module, on the primary (first) device.
        inputs: the positional inputs (a tuple; anything else is the only input).
        device_ids: accelerator indices, as torch; or ``devices=``, any form (``"cpu:2"``).
        output_device: where the outputs are gathered (``-1``: the CPU; default: the primary).
        dim: the batch dimension.
        module_kwargs: keyword inputs, scattered alongside.

    Returns:
        The gathered outputs; gradients flow back to ``module``'s parameters.

    Example:
        >>> multigpu.data_parallel(nn.Linear(4, 2), torch.randn(6, 4), devices="cpu:2").shape
        torch.Size([6, 2])
    """
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    model = DataParallel(module, device_ids, output_device, dim, devices=devices)
    try:
        return model(*inputs, **(module_kwargs or {}))
    finally:
        model.close()


def _apply_devices(modules: Sequence[nn.Module], devices: Devices | Sequence[None] | None) -> list[ReplicaDevice]:
    if devices is None or (not isinstance(devices, str) and all(d is None for d in devices)):
        found = [next((p.device for p in m.parameters()), torch.device("cpu")) for m in modules]
        devices = [str(d) for d in found]
    parsed = parse_devices(devices)  # type: ignore[arg-type]
    if len(parsed) != len(modules):
        raise ConfigError(f"parallel_apply got {len(modules)} modules and {len(parsed)} devices; give one per module")
    return parsed
