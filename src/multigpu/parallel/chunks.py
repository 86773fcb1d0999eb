"""How a batch is divided among replicas: even split, fixed sizes, or weights.

``chunk_sizes`` on :class:`multigpu.DataParallel` accepts:

* ``None``: even split, the first replicas taking the remainder;
* a list of ints summing to the batch, e.g. ``[24, 40]`` (exactly those sizes);
* a list of float weights, e.g. ``[0.4, 0.6]`` or ``[1.0, 2.0]``:
  scaled to whatever batch arrives with largest-remainder rounding.

A replica whose chunk is 0 does not run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from multigpu.errors import ConfigError
from multigpu.parallel.scatter_gather import even_chunk_sizes


@dataclass(frozen=True)
class ChunkPolicy:
    """Fixed sizes, weights or an even split (``spec=None``), for ``replicas`` devices."""

    spec: tuple[float, ...] | None
    replicas: int

    def __post_init__(self) -> None:
        if self.spec is None:
            return
        if len(self.spec) != self.replicas:
            raise ConfigError(
                f"chunk_sizes={list(self.spec)} has {len(self.spec)} entries for {self.replicas} devices; "
                "give one size or weight per device"
            )
        if not all(_finite(v) for v in self.spec) or not _finite(sum(map(_as_float, self.spec))):
            raise ConfigError(
                f"chunk_sizes={list(self.spec)} must hold finite numbers (no NaN or infinity, and a total "
                "below 1e308); give sizes like [24, 40] or weights like [0.4, 0.6]"
            )
        if any(v < 0 for v in self.spec) or sum(self.spec) <= 0:
            raise ConfigError(
                f"chunk_sizes={list(self.spec)} must be non-negative with a positive total; use 0 to leave a device out"
            )

    def sizes(self, batch: int) -> list[int]:
        """The chunk sizes for a batch of ``batch`` samples.

        Raises:
            ConfigError: fixed sizes that do not add up to ``batch``.
        """
        if self.spec is None:
            return even_chunk_sizes(batch, self.replicas)
        if all(isinstance(v, int) for v in self.spec):
            if sum(self.spec) != batch:
                raise ConfigError(
                    f"chunk_sizes={list(self.spec)} sums to {int(sum(self.spec))} but the batch has {batch} "
                    "samples; give sizes that sum to the batch, or float weights such as [0.4, 0.6] "
                    "that scale to any batch"
                )
            return [int(v) for v in self.spec]
        return proportional_sizes(batch, self.spec)


def _as_float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond float range
        return math.inf


def _finite(value: float) -> bool:
    return math.isfinite(_as_float(value))


def proportional_sizes(batch: int, weights: Sequence[float]) -> list[int]:
    """Split ``batch`` in proportion to ``weights``, largest remainder first (ties: lower index).

    Example:
        >>> proportional_sizes(10, [1, 1, 1])
        [4, 3, 3]
    """
    peak = max(weights)  # scaled to at most 1 first: batch * w overflows for weights near the float limit
    scaled = [w / peak for w in weights]
    total = sum(scaled)
    exact = [batch * w / total for w in scaled]
    sizes = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[: batch - sum(sizes)]:
        sizes[i] += 1
    return sizes


def build_policy(chunk_sizes: Sequence[float] | str | None, replicas: int) -> ChunkPolicy:
    """Validate ``chunk_sizes`` as given to DataParallel and build its policy."""
    if chunk_sizes is None:
        return ChunkPolicy(None, replicas)
    if isinstance(chunk_sizes, str) or not isinstance(chunk_sizes, Sequence):
        raise ConfigError(
            f"chunk_sizes={chunk_sizes!r} is not a list; pass sizes like [24, 40], weights like [0.4, 0.6], "
            "'auto', or None"
        )
    try:
        if any(isinstance(v, (bool, str, bytes)) for v in chunk_sizes):
            raise TypeError("not a number")
        values = tuple(float(v) if isinstance(v, float) else int(v) for v in chunk_sizes)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(
            f"chunk_sizes={list(chunk_sizes)!r} must hold numbers: sizes like [24, 40] or weights like [0.4, 0.6]"
        ) from exc
    return ChunkPolicy(values, replicas)
