"""Peak memory per device for each strategy, and the chunk sizes that even it out.

One function per strategy; :func:`multigpu.planning.costs.device_memory` picks one by name.

    weights W = params * bytes/param (fp32 4, amp 6), gradients G = params * 4,
    optimizer state O = params * (sgd 0, momentum 4, adam 8)      (ZeRO paper; HF docs)
    single          W + G + O + B*(a + o) + ctx
    DP primary      W + G + O + b_0*(a + o) + gathered outputs of the whole batch + ctx
    DP replica i    W + G (replica copies, freed after the step) + b_i*(a + o) + ctx
    DDP process     W + G + bucket buffer (G) + O + b*(a + o) + ctx
    FSDP process    P*(4 + 4 + k)/N + 2p*U_0 + (3p + r)*L + b*(a + o) + ctx

with a the activation bytes and o the output bytes of one sample. On CPU replicas share the
primary's weights (no copies). FSDP: k optimizer bytes per parameter, p the bytes of a gathered
parameter (4; 2 under amp), r of a reduced gradient (4), U_0 the root's group, L the largest other
group (:func:`fsdp_memory` says what each term holds).

Example:
    >>> bytes_per_param(Workload(name="m", params=1, compute_s_per_sample=1.0, optimizer="adam"))
    16.0
"""

from __future__ import annotations

from collections.abc import Sequence

from multigpu.parallel.balance import water_fill
from multigpu.parallel.scatter_gather import even_chunk_sizes
from multigpu.planning.hardware import Platform
from multigpu.planning.workload import (
    FSDP_GATHER_BYTES,
    OPTIMIZER_STATE,
    PRECISION_GRAD_BYTES,
    PRECISION_WEIGHT_BYTES,
    Workload,
)


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


def fsdp_gather_bytes(w: Workload) -> float:
    """Bytes of one parameter as fsdp all-gathers and computes with it (fp32 4, amp's bf16/fp16 2)."""
    return FSDP_GATHER_BYTES[w.precision]


def fsdp_reduce_bytes(w: Workload) -> float:
    """Bytes of one gradient as fsdp reduce-scatters it (fp32 unless amp with ``reduce_fp32=False``)."""
    return 4.0 if w.fsdp.reduce_fp32 else fsdp_gather_bytes(w)


def sharded_state_bytes(w: Workload, devices: int) -> float:
    """Parameters, gradients and optimizer state one fsdp process holds: ``P (4 + 4 + k) / N``.

    FSDP2 keeps the sharded parameters and gradients in fp32 also under amp (it casts at the
    all-gather), so fp32 and amp Adam both hold 16 bytes per parameter over N: ZeRO stage 3's
    ``(2 + 2 + K) P / N`` with K = 12 (Rajbhandari et al. 2020), split 4 + 4 + 8 instead of 2 + 2 + 12.

    Example:
        >>> sharded_state_bytes(Workload(name="m", params=7_500_000_000, compute_s_per_sample=1.0), 64) / 1e9
        1.875
    """
    return w.params * (4.0 + 4.0 + OPTIMIZER_STATE[w.optimizer]) / devices


def fsdp_memory(w: Workload, plat: Platform, chunks: Sequence[int]) -> list[float]:
    """Peak bytes of each fsdp process, summing terms that peak at nearby moments (a bound).

    Besides its shards: the root's group stays gathered from its forward to the end of backward
    (torch's default for the root) and its gradients wait unsharded for the root's reduce-scatter,
    the last of the step (``2p U_0``). Around the largest other group (``L``): its gathered
    parameters, the next group's all-gather output (prefetched), its gradients in the compute
    dtype, and the previous group's reduce-scatter input still in flight: ``(3p + r) L``. With
    ``reshard_after_forward=False`` every group stays gathered from forward to backward
    (``p P``) and nothing is prefetched in backward: ``p P + p U_0 + (p + r) L``.
    """
    n = len(chunks)
    p, r = fsdp_gather_bytes(w), fsdp_reduce_bytes(w)
    groups = w.fsdp.resolved(w.params)
    root, largest = groups[0], max(groups[1:], default=0)
    if w.fsdp.reshard_after_forward:
        held = 2 * p * root + (3 * p + r) * largest
    else:
        held = p * w.params + p * root + (p + r) * largest
    return [sharded_state_bytes(w, n) + held + b * _per_sample(w) + plat.context_bytes for b in chunks]


def single_memory(w: Workload, plat: Platform, chunks: Sequence[int]) -> list[float]:
    """Peak bytes of one device running the whole batch."""
    return [_state(w) + sum(chunks) * _per_sample(w) + plat.context_bytes]


def dataparallel_memory(w: Workload, plat: Platform, chunks: Sequence[int]) -> list[float]:
    """Peak bytes of each DataParallel device: the primary (index 0) holds the state and the gathered outputs."""
    ctx = plat.context_bytes
    primary = _state(w) + chunks[0] * _per_sample(w) + _gathered(w, sum(chunks)) + ctx
    others = [_replica_copies(w, plat) + b * _per_sample(w) + ctx for b in chunks[1:]]
    return [primary, *others]


def ddp_memory(w: Workload, plat: Platform, chunks: Sequence[int]) -> list[float]:
    """Peak bytes of each DDP process: the full state and one gradient-sized bucket buffer."""
    bucket = w.grad_bytes if len(chunks) > 1 else 0.0
    return [_state(w) + bucket + b * _per_sample(w) + plat.context_bytes for b in chunks]


def balanced_chunks(w: Workload, plat: Platform, devices: int, batch: int) -> list[int]:
    """DataParallel chunk sizes that make every device's peak memory as equal as they can be.

    The primary carries the optimizer state and the gathered outputs, so it takes fewer samples:
    device i's peak is ``E_i + b_i * p`` (p: bytes per sample), levelled by the engine's own
    water-filling (:func:`multigpu.parallel.balance.water_fill`), as ``chunk_sizes="auto"`` does.

    Example:
        >>> from multigpu.planning.hardware import gpu, gpu_platform, link
        >>> w = Workload(name="m", params=10**8, compute_s_per_sample=0.01, activation_bytes_per_sample=1e8)
        >>> balanced_chunks(w, gpu_platform(gpu("v100-32gb"), link("nvlink-v100")), 2, 64)
        [28, 36]
    """
    per_sample = _per_sample(w)
    if devices == 1 or per_sample <= 0:
        return even_chunk_sizes(batch, devices)
    bases = [_state(w) + _gathered(w, batch)] + [_replica_copies(w, plat)] * (devices - 1)
    return water_fill(bases, [per_sample] * devices, batch)
