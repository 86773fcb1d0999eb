"""DDP step profile: per-rank step time, time in all-reduce, bytes reduced, and stragglers.

Works on a plain ``torch.nn.parallel.DistributedDataParallel`` model. A communication hook wraps
the all-reduce (``allreduce_hook`` by default, or the hook you pass) and records, per gradient
bucket, its bytes and when it went out and came back; an optimizer hook ends each step. In DDP
the ranks wait for each other inside the all-reduce, so a slow rank shows up as *less* time in
all-reduce and more busy time (step time minus all-reduce time) than the others: the straggler
is the rank with the most busy time, compared with the median rank.

DDP allows one communication hook per model, registered before the first backward: create the
profiler right after wrapping the model. After the block the hook stays but only passes through.

Example (every rank runs this):
    >>> model = DistributedDataParallel(net)
    >>> with profile_ddp(model, optimizer=opt) as prof:
    ...     for x, y in loader:
    ...         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    >>> profile = prof.gather()          # collective: every rank must call it
    >>> profile.straggler().rank
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from multigpu.core.units import format_ms
from multigpu.errors import ConfigError
from multigpu.profiling import clock
from multigpu.runtime import world as runtime
from multigpu.runtime.exchange import gather_object

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


@dataclass
class RankProfile:
    """One rank's steps: wall time, time with an all-reduce in flight, bytes reduced, buckets."""

    rank: int
    step_s: list[float]
    allreduce_s: list[float]
    allreduce_bytes: list[int]
    buckets: list[int]

    def busy_s(self) -> float:
        """Median step time outside the all-reduce (what makes a rank slow, not what it waits for)."""
        return statistics.median(max(0.0, s - a) for s, a in zip(self.step_s, self.allreduce_s)) if self.step_s else 0.0


@dataclass(frozen=True)
class Straggler:
    """The slowest rank (most busy time) against the median rank."""

    rank: int
    busy_s: float
    median_busy_s: float
    ratio: float
    is_straggler: bool

    def describe(self) -> str:
        verdict = "straggler" if self.is_straggler else "no straggler"
        return (
            f"{verdict}: rank {self.rank} is busy {format_ms(self.busy_s)} per step, "
            f"{self.ratio:.2f}x the median rank ({format_ms(self.median_busy_s)})"
        )


@dataclass
class DDPProfile:
    """Every rank's :class:`RankProfile`, as gathered by :meth:`DDPProfiler.gather`."""

    backend: str
    ranks: list[RankProfile]

    def straggler(self, threshold: float = 1.2) -> Straggler:
        """Name the rank with the most busy time; it is a straggler when ``ratio >= threshold``."""
        if threshold < 1.0:
            raise ConfigError(f"threshold={threshold} must be >= 1.0 (slowest rank over median rank)")
        busy = {r.rank: r.busy_s() for r in self.ranks}
        slowest = max(busy, key=lambda rank: busy[rank])
        median = statistics.median(busy.values())
        ratio = busy[slowest] / median if median > 0 else 1.0
        return Straggler(slowest, busy[slowest], median, ratio, ratio >= threshold)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> DDPProfile:
        raw = json.loads(text)
        return DDPProfile(backend=raw["backend"], ranks=[RankProfile(**r) for r in raw["ranks"]])


class DDPProfiler:
    """Times the all-reduce of every bucket and every step of one rank (see the module docstring)."""

    def __init__(
        self,
        model: DistributedDataParallel,
        *,
        warmup: int = 1,
        inner_hook: CommHook | None = None,
        hook_state: Any = None,
    ) -> None:
        if warmup < 0:
            raise ConfigError(f"warmup={warmup} must be >= 0 (steps to run before keeping numbers)")
        if not isinstance(model, DistributedDataParallel):
            raise ConfigError(
                f"profile_ddp needs a DistributedDataParallel model, got {type(model).__name__}; wrap it first"
            )
        self.warmup = warmup
        self.enabled = True
        self._inner: CommHook = inner_hook or default_hooks.allreduce_hook
        param = next(model.parameters())
        self._on = None if param.device.type == "cpu" else param.device  # timed as its device type marks time
        self._buckets: list[tuple[clock.Mark, clock.Mark, int]] = []
        self._steps: list[tuple[clock.Mark, clock.Mark, list[tuple[clock.Mark, clock.Mark, int]]]] = []
        self._seen = 0
        self._step_start = clock.mark(self._on)
        model.register_comm_hook(hook_state, self._hook)

    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]
        # No annotations: DDP compares the hook's annotations with dist.GradBucket, and this
        # module's postponed (string) annotations would fail that check.
        if not self.enabled:
            return self._inner(state, bucket)
        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        start = clock.mark(self._on)
        future = self._inner(state, bucket)

        def done(fut: torch.futures.Future) -> Any:
            self._buckets.append((start, clock.mark(self._on), nbytes))  # runs on the backend's thread
            return fut.value()

        return future.then(done)

    def step(self, *_: Any) -> None:
        """End a step (the optimizer hook calls it; call it yourself without an optimizer)."""
        if not self.enabled:
            return
        stop = clock.mark(self._on)
        buckets, self._buckets = self._buckets, []
        if self._seen >= self.warmup:
            self._steps.append((self._step_start, stop, buckets))
        self._seen += 1
        self._step_start = clock.mark(self._on)

    def rank_profile(self) -> RankProfile:
        """This rank's kept steps (reads device events: a sync point)."""
        out = RankProfile(rank=runtime.global_rank(), step_s=[], allreduce_s=[], allreduce_bytes=[], buckets=[])
        for start, stop, buckets in self._steps:
            out.step_s.append(clock.seconds_between(start, stop))
            spans = [(clock.seconds_between(start, a), clock.seconds_between(start, b)) for a, b, _ in buckets]
            out.allreduce_s.append(_union_length(spans))
            out.allreduce_bytes.append(sum(n for _, _, n in buckets))
            out.buckets.append(len(buckets))
        return out

    def gather(self) -> DDPProfile:
        """Every rank's profile, on every rank. Collective: every rank must call it."""
        mine = self.rank_profile()
        if not runtime.in_process_group():
            return DDPProfile(backend="none", ranks=[mine])
        # through the collectives' one door (runtime.collectives.issuing): in the rank's ledger, checked under --debug
        everyone = gather_object(mine, "DDP profile (every rank's timings, all-gather)")
        return DDPProfile(backend=str(dist.get_backend()), ranks=sorted(everyone, key=lambda r: r.rank))


@contextlib.contextmanager
def profile_ddp(
    model: DistributedDataParallel,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    warmup: int = 1,
    inner_hook: CommHook | None = None,
    hook_state: Any = None,
) -> Iterator[DDPProfiler]:
    """Profile the DDP steps run inside the block on this rank; every rank must enter it.

    Args:
        model: the DDP-wrapped model, before its first backward (DDP allows one comm hook).
        optimizer: its ``step()`` ends a step; None: call ``prof.step()`` yourself.
        warmup: steps run but not kept.
        inner_hook, hook_state: the communication hook to time (default: DDP's plain all-reduce).

    Returns:
        The profiler; after the block call ``.gather()`` on every rank.
    """
    profiler = DDPProfiler(model, warmup=warmup, inner_hook=inner_hook, hook_state=hook_state)
    handle = optimizer.register_step_post_hook(profiler.step) if optimizer is not None else None
    try:
        yield profiler
    finally:
        profiler.enabled = False
        if handle is not None:
            handle.remove()


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of intervals (buckets in flight at the same time count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
