"""Measure this machine's host costs (:class:`~multigpu.planning.host.HostCosts`) in about a second.

Each constant is the fastest of ``repeats`` timings of a probe (other work on a shared machine
only adds time) divided by the items it holds, counted as :mod:`multigpu.planning.counting` counts:

- ``op_s``: ``y = y.add(1)`` on a one-element tensor, from Python (one dispatched op each);
- ``module_call_s``: an ``nn.Sequential`` of ``nn.Identity`` modules (calls without ops);
- ``backward_op_s``: backward of a chain of multiplications, over the ops it dispatches;
- ``gil_contention``: the op loop on ``threads`` long-lived threads at once, over ``threads`` times
  one thread's time (1: the GIL serialises them perfectly; above 1: taking turns costs extra);
- ``replicate_module_s`` / ``replicate_tensor_s``: replicating a tree of empty modules, and one
  module holding many parameters, per module and per tensor. ``replicate="torch"`` times
  ``torch.nn.parallel.replicate`` (what nn.DataParallel runs on GPUs; its CUDA-only coalesced
  broadcast replaced by detached views, whose bytes the broadcast term of the model pays);
  ``"multigpu"`` times the engine's own :func:`multigpu.parallel.replicas.build_replicas`;
- ``fsdp_group_s``: a training step (zero_grad, forward, backward, SGD step) of a stack of tiny
  Linear layers, each its own ``fully_shard`` group, against the same stack unsharded, per group:
  FSDP2's hooks and bookkeeping, in a one-process gloo group (no collective runs). Where a process
  group already exists the probe is skipped and the development machine's figure kept.

Run it:  python -m multigpu.planning.calibrate

Example:
    >>> measure_host_costs(items=200, repeats=2).op_s > 0
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import torch
from torch import nn

from multigpu.errors import ConfigError
from multigpu.parallel.replicas import build_replicas
from multigpu.planning.counting import OpCounter
from multigpu.planning.host import DEFAULT_HOST, TIME_FIELDS, HostCosts
from multigpu.profiling.bandwidth import time_per_op


def fastest_s(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls after one warm-up (the profiler's timer, one call per loop)."""
    return time_per_op(fn, lambda: None, iters=1, repeats=repeats)


def _op_loop(items: int) -> Callable[[], object]:
    x = torch.ones(1)

    def run() -> None:
        y = x
        for _ in range(items):
            y = y.add(1)

    return run


def _module_call_s(items: int, repeats: int) -> float:
    modules, x = nn.Sequential(*[nn.Identity() for _ in range(items)]), torch.ones(1)
    return fastest_s(lambda: modules(x), repeats) / items


def _backward_op_s(items: int, repeats: int) -> float:
    x = torch.ones(1, requires_grad=True)

    def forward() -> torch.Tensor:
        y = x
        for _ in range(items):
            y = y * 1.0
        return y

    counter = OpCounter()
    loss = forward()
    with counter:
        loss.backward()
    both = fastest_s(lambda: forward().backward(), repeats)
    return max(0.0, both - fastest_s(forward, repeats)) / counter.total


def _gil_contention(items: int, repeats: int, threads: int) -> float:
    loop = _op_loop(items)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="multigpu-calibrate") as pool:
        alone = fastest_s(lambda: pool.submit(loop).result(), repeats)
        together = fastest_s(lambda: [f.result() for f in [pool.submit(loop) for _ in range(threads)]], repeats)
    return together / (threads * alone)


def _views(
    tensors: Sequence[torch.Tensor], devices: Sequence[object], detach: bool = False
) -> list[list[torch.Tensor]]:
    return [[t.detach() for t in tensors] for _ in devices]


def _replicate_fn(which: str) -> Callable[[nn.Module], object]:
    if which == "multigpu":
        return lambda module: build_replicas(module, [torch.device("cpu")])
    if which == "torch":
        torch_replicate = importlib.import_module("torch.nn.parallel.replicate")

        def run(module: nn.Module) -> object:
            with mock.patch.object(torch_replicate, "_broadcast_coalesced_reshape", _views):
                return torch_replicate.replicate(module, [0])

        return run
    raise ConfigError(f"replicate={which!r} is not one of 'torch' (nn.DataParallel) or 'multigpu' (the engine)")


def _replicate_costs(items: int, repeats: int, which: str) -> tuple[float, float]:
    """(seconds per module, seconds per tensor) of one replica."""
    run = _replicate_fn(which)
    modules = nn.Sequential(*[nn.Identity() for _ in range(items)])
    per_module = fastest_s(lambda: run(modules), repeats) / (items + 1)
    tensors = nn.ParameterList([nn.Parameter(torch.ones(1)) for _ in range(items)])
    with_tensors = fastest_s(lambda: run(tensors), repeats)
    return per_module, max(0.0, with_tensors - per_module) / items


def _fsdp_group_s(groups: int, repeats: int) -> float | None:
    """Seconds of FSDP2's own work per group and step; None where a process group already exists."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or dist.is_initialized():
        return None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = nn.Sequential(*[nn.Linear(4, 4) for _ in range(groups)])
        sharded = nn.Sequential(*[nn.Linear(4, 4) for _ in range(groups)])
        for block in sharded:
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        x = torch.ones(2, 4)

        def step(model: nn.Module) -> Callable[[], None]:
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

            def run() -> None:
                opt.zero_grad(set_to_none=True)
                model(x).sum().backward()
                opt.step()

            return run

        extra = fastest_s(step(sharded), repeats) - fastest_s(step(plain), repeats)
        return max(0.0, extra) / (groups + 1)  # the root is a group too
    finally:
        dist.destroy_process_group()


def measure_host_costs(
    *, items: int = 2000, repeats: int = 7, threads: int = 2, replicate: str = "multigpu", fsdp_groups: int = 16
) -> HostCosts:
    """This machine's host costs (seconds per item; ``launch_s`` 0: add a GPU's with ``.on_gpu()``).

    Args:
        items: ops, modules or tensors per probe.
        repeats: timed repeats per probe; the fastest is kept.
        threads: threads for the GIL probe (at most the cores free for them).
        replicate: whose replicate to time: ``"multigpu"`` (the engine, as CPU replicas run it)
            or ``"torch"`` (nn.DataParallel's, as GPU replicas in public reports run it).
        fsdp_groups: groups of the fsdp probe (0: keep the development machine's figure).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # one-element ops: the intra-op pool would only add noise
    try:
        replicate_module_s, replicate_tensor_s = _replicate_costs(items, repeats, replicate)
        fsdp = _fsdp_group_s(fsdp_groups, repeats) if fsdp_groups else None
        return HostCosts(
            op_s=fastest_s(_op_loop(items), repeats) / items,
            module_call_s=_module_call_s(items, repeats),
            backward_op_s=_backward_op_s(items, repeats),
            gil_contention=max(1.0 / threads, _gil_contention(items, repeats, threads)),
            replicate_module_s=replicate_module_s,
            replicate_tensor_s=replicate_tensor_s,
            fsdp_group_s=DEFAULT_HOST.fsdp_group_s if fsdp is None else fsdp,
            source=f"measured here (fastest of {repeats}, {items} items per probe, {replicate} replicate)",
        )
    finally:
        torch.set_num_threads(previous)


def _main() -> None:
    for which in ("torch", "multigpu"):
        host = measure_host_costs(replicate=which, repeats=15)
        print(f"-- replicate: {which}")
        for name in TIME_FIELDS:
            print(f"{name:20s} {getattr(host, name) * 1e6:8.2f} us")
        print(f"{'gil_contention':20s} {host.gil_contention:8.2f}")


if __name__ == "__main__":
    _main()
