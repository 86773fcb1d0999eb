"""Peak memory per device for each strategy, and the chunk sizes that even it out.

    weights W = params * bytes/param (fp32 4, amp 6), gradients G = params * 4,
    optimizer state O = params * (sgd 0, momentum 4, adam 8)      (ZeRO paper; HF docs)
    single          W + G + O + B*(a + o) + ctx
    DP primary      W + G + O + b_0*(a + o) + gathered outputs of the whole batch + ctx
    DP replica i    W + G (replica copies, freed after the step) + b_i*(a + o) + ctx
    DDP process     W + G + bucket buffer (G) + O + b*(a + o) + ctx

with a the activation bytes and o the output bytes of one sample. On CPU replicas share the
primary's weights (no copies).

Example:
    >>> from multigpu.planning.workload import Workload
    >>> bytes_per_param(Workload(name="m", params=1, compute_s_per_sample=1.0, optimizer="adam"))
    16.0
"""

from __future__ import annotations

from collections.abc import Sequence

from multigpu.parallel.balance import water_fill
from multigpu.parallel.scatter_gather import even_chunk_sizes
from multigpu.planning.platform import Platform
from multigpu.planning.workload import OPTIMIZER_STATE, PRECISION_GRAD_BYTES, PRECISION_WEIGHT_BYTES, Workload


def bytes_per_param(w: Workload) -> float:
    """Weights + gradients + optimizer state per parameter (fp32 Adam: 16; amp Adam: 18)."""
    return PRECISION_WEIGHT_BYTES[w.precision] + PRECISION_GRAD_BYTES[w.precision] + OPTIMIZER_STATE[w.optimizer]


def _state(w: Workload) -> float:
    return w.params * bytes_per_param(w)


def _replica_copies(w: Workload, plat: Platform) -> float:
    weights = w.params * PRECISION_WEIGHT_BYTES[w.precision] if plat.peer_copies else 0.0
    return weights + w.params * PRECISION_GRAD_BYTES[w.precision]


def _per_sample(w: Workload) -> float:
    return w.activation_bytes_per_sample + w.output_bytes_per_sample


def _gathered(w: Workload, batch: int) -> float:
    return batch * w.output_bytes_per_sample * (1 if w.loss_on_replicas else 2)


def device_memory(strategy: str, w: Workload, plat: Platform, chunks: Sequence[int]) -> list[float]:
    """Peak bytes on each device (index 0 is the primary for DataParallel).

    Args:
        strategy: ``single``, ``dp``, ``dp-balanced`` or ``ddp``.
        w: the workload.
        plat: the platform (CUDA context per process, whether replicas copy weights).
        chunks: samples per device.
    """
    ctx = plat.context_bytes
    if strategy == "single":
        return [_state(w) + sum(chunks) * _per_sample(w) + ctx]
    if strategy == "ddp":
        bucket = w.grad_bytes if len(chunks) > 1 else 0.0
        return [_state(w) + bucket + b * _per_sample(w) + ctx for b in chunks]
    primary = _state(w) + chunks[0] * _per_sample(w) + _gathered(w, sum(chunks)) + ctx
    others = [_replica_copies(w, plat) + b * _per_sample(w) + ctx for b in chunks[1:]]
    return [primary, *others]


def balanced_chunks(w: Workload, plat: Platform, devices: int, batch: int) -> list[int]:
    """DataParallel chunk sizes that make every device's peak memory as equal as they can be.

    The primary carries the optimizer state and the gathered outputs, so it takes fewer samples:
    device i's peak is ``E_i + b_i * p`` (p: bytes per sample), levelled by the engine's own
    water-filling (:func:`multigpu.parallel.balance.water_fill`), as ``chunk_sizes="auto"`` does.

    Example:
        >>> from multigpu.planning.workload import Workload
        >>> from multigpu.planning.hardware import gpu, link
        >>> from multigpu.planning.platform import gpu_platform
        >>> w = Workload(name="m", params=10**8, compute_s_per_sample=0.01, activation_bytes_per_sample=1e8)
        >>> balanced_chunks(w, gpu_platform(gpu("v100-32gb"), link("nvlink-v100")), 2, 64)
        [28, 36]
    """
    per_sample = _per_sample(w)
    if devices == 1 or per_sample <= 0:
        return even_chunk_sizes(batch, devices)
    bases = [_state(w) + _gathered(w, batch)] + [_replica_copies(w, plat)] * (devices - 1)
    return water_fill(bases, [per_sample] * devices, batch)
