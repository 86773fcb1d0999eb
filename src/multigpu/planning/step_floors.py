"""What an engine adds to every step whatever the model computes, timed through the engine on a tiny model.

A step of a model too small to compute anything (two ``Linear(4, 4)``) run through an engine, against
the same step run plainly, is what the engine itself costs per step: its Python, its thread
hand-offs, its waits on the other process. Timed in seconds, in the process that will use it:

- :func:`dp_handoff_s` (the planner's process): DataParallel's step (:class:`multigpu.DataParallel`
  on ``cpu:N``: scatter, replicate, a forward in each replica thread, gather, a backward in each
  replica thread, the gradients summed) over the plain step, less the replicate (timed apart: the
  plan charges it per module and tensor), per replica and phase. A pool thread's bare hand-off
  (``ThreadPoolExecutor.submit`` of a no-op) read 20 us on the 2 development cores; the engine's
  read 0.3-0.4 ms per replica and phase (at load 7, and 1-1.4 ms a step at quiet): a woken thread
  must take the GIL from the thread that woke it, every time.
- :func:`ddp_step_s` (each of the machine probe's two processes, every rank calls it): DDP's step
  over the plain step, less one all-reduce of the tiny model's gradients (the plan charges each
  bucket's all-reduce apart): the reducer's work, its hooks and the waits of two processes meeting
  at the all-reduce (one process's scheduling jitter is the other's wait).

Each is a low quantile (:data:`~multigpu.planning.timing.WAIT_QUANTILE`, the 5th fastest of
:data:`REPEATS`) of wall times (the engine's threads or the other process are in the step, so not the
thread's CPU time: a step that waits is never faster than when every thread holds a core), each call
well under a scheduler slice; the plain step and the engine's are timed in alternation, so a load
that lasts a moment moves both.

Example:
    >>> dp_handoff_s(repeats=5) >= 0
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from multigpu.planning.timing import WAIT_QUANTILE, low_quantile

REPEATS = 60  # timed calls of each kind (a tiny step takes 0.3-2 ms: well under a second in all)
WARMUP = 10  # calls of each kind first (thread pools, allocator arenas, DDP's first-iteration work)
_BATCH = 8


def tiny_model() -> nn.Module:
    """Two ``Linear(4, 4)`` with a ReLU between, from a fixed seed, without moving the caller's random streams."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def _training_step(model: nn.Module) -> Callable[[], None]:
    x = torch.ones(_BATCH, 4)

    def run() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    return run


def paired_s(plain: Callable[[], object], engine: Callable[[], object], repeats: int = REPEATS) -> tuple[float, float]:
    """(plain, engine): the :data:`~multigpu.planning.timing.WAIT_QUANTILE` of ``repeats`` wall times of each,
    called in alternation after :data:`WARMUP` calls of each."""
    for _ in range(WARMUP):
        plain()
        engine()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, kept in zip((plain, engine), times):
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return low_quantile(times[0], WAIT_QUANTILE), low_quantile(times[1], WAIT_QUANTILE)


def dp_handoff_s(replicas: int = 2, repeats: int = REPEATS) -> float:
    """Seconds DataParallel's engine adds per replica and phase (forward, backward) on ``cpu:<replicas>``,
    beyond the replicate (see the module's docstring); one intra-op thread per replica, as on 2 cores."""
    from multigpu.parallel import DataParallel
    from multigpu.parallel.replicas import build_replicas

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model()
        engine = DataParallel(model, devices=f"cpu:{replicas}")
        try:
            devices = [torch.device("cpu")] * replicas
            plain_s, engine_s = paired_s(_training_step(model), _training_step(engine), repeats)
            replicate = paired_s(lambda: None, lambda: build_replicas(model, devices), repeats)[1]
        finally:
            engine.close()
    finally:
        torch.set_num_threads(previous)
    return max(0.0, engine_s - plain_s - replicate) / (2 * replicas)


def ddp_step_s(allreduce_s: Callable[[int], float], repeats: int = REPEATS) -> float:
    """Seconds DDP adds to a step in the default (gloo) process group beyond its one bucket's all-reduce
    (``allreduce_s(nbytes)``: seconds of one all-reduce of ``nbytes``, as the plan charges it). Every rank
    must call it (it runs collectives); the figure of the slower rank is the step's."""
    from torch.nn.parallel import DistributedDataParallel

    from multigpu.strategies.ddp import drop_reducer

    model = tiny_model()
    wrapped = DistributedDataParallel(tiny_model())
    try:
        plain_s, ddp_s = paired_s(_training_step(model), _training_step(wrapped), repeats)
    finally:  # a reducer alive when its group is destroyed aborts the process at exit, now and then
        drop_reducer(wrapped)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(0.0, ddp_s - plain_s - allreduce_s(grads))
