"""What is trained: the numbers the time and memory models need from a model and its step.

A :class:`Workload` comes from counting a model's step on the meta device
(:mod:`multigpu.planning.counting`) and, on this CPU, timing it (:mod:`multigpu.planning.measure`),
from a built-in preset (:mod:`multigpu.planning.models`), or from flags. Its :class:`StepCounts`
are what the host (Python, the dispatcher, kernel launches) pays per step, whatever the batch;
its :class:`FsdpLayout`, how the fsdp strategy groups its parameters.

Example:
    >>> w = Workload(name="mlp", params=2_000_000, compute_s_per_sample=1e-4)
    >>> w.grad_bytes
    8000000
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from multigpu.errors import ConfigError

# Bytes of memory traffic per parameter of one optimizer step (fp32 state): read what it reads,
# write what it writes. SGD reads p, g and writes p; momentum adds a read and a write of the
# buffer; Adam reads p, g, m, v and writes p, m, v.
OPTIMIZER_TRAFFIC = {"sgd": 12, "sgd-momentum": 20, "adam": 28, "adamw": 28}
# Bytes of optimizer state per parameter (fp32), ZeRO paper / HF performance docs.
OPTIMIZER_STATE = {"sgd": 0, "sgd-momentum": 4, "adam": 8, "adamw": 8}
# Bytes per parameter for weights and gradients, by precision. "amp" keeps fp32 weights and
# gradients and a half-precision weight copy for the forward (HF docs: 18 bytes/param with Adam).
PRECISION_WEIGHT_BYTES = {"fp32": 4.0, "amp": 6.0}
PRECISION_GRAD_BYTES = {"fp32": 4.0, "amp": 4.0}
# fsdp: the dtype parameters are all-gathered and computed in (FSDP2's MixedPrecisionPolicy
# param_dtype: bf16/fp16 under amp). Sharded parameters, gradients and optimizer state stay fp32.
FSDP_GATHER_BYTES = {"fp32": 4.0, "amp": 2.0}
# The default grouping rule (multigpu's FSDPOptions.max_share): no group above a tenth of the model.
FSDP_DEFAULT_MAX_SHARE = 0.1


@dataclass(frozen=True, kw_only=True)
class StepCounts:
    """What one training step asks of the host, independent of the batch (all zero: not counted).

    Counted by :func:`multigpu.planning.counting.count_step`; each is a plain count.
    """

    modules: int = 0  # modules in the tree: DataParallel's replicate copies each, per replica, per step
    tensors: int = 0  # parameters + buffers: replicate hands each to every replica
    module_calls: int = 0  # nn.Module calls in forward (Python hook machinery each)
    forward_ops: int = 0  # aten ops dispatched by forward and the loss
    backward_ops: int = 0  # aten ops dispatched by backward
    forward_kernels: int = 0  # of the forward ops, those that launch a device kernel (not views)
    backward_kernels: int = 0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 0:
                raise ConfigError(f"StepCounts.{name}={getattr(self, name)} must be >= 0 (a count)")
        if self.forward_kernels > self.forward_ops or self.backward_kernels > self.backward_ops:
            raise ConfigError(
                f"kernels ({self.forward_kernels} forward, {self.backward_kernels} backward) cannot exceed the "
                f"ops that launch them ({self.forward_ops}, {self.backward_ops})"
            )


@dataclass(frozen=True, kw_only=True)
class FsdpLayout:
    """How the ``fsdp`` strategy groups and gathers the model (the Session's ``FSDPOptions``).

    Attributes:
        groups: trainable parameters of each all-gather group in forward order, the root's own
            group first (what no block claims: small layers, tied weights); empty: not counted,
            the default rule's bound is assumed (:meth:`resolved`).
        reshard_after_forward: blocks free their gathered parameters after forward and gather
            them again in backward (the default); False keeps them gathered until backward.
        reduce_fp32: under amp, gradients are reduce-scattered in fp32 (the default), else in 16 bits.
    """

    groups: tuple[int, ...] = ()
    reshard_after_forward: bool = True
    reduce_fp32: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(int(g) for g in self.groups))
        if any(g < 0 for g in self.groups) or (self.groups and sum(self.groups) == 0):
            raise ConfigError(
                f"FsdpLayout(groups={list(self.groups)}) must count parameters per group (>= 0, not all 0)"
            )

    def resolved(self, params: int) -> tuple[int, ...]:
        """The groups, root first; not counted: an empty root and groups of a tenth of ``params`` each
        (the most the default rule lets one group hold)."""
        if self.groups:
            return self.groups
        count = round(1 / FSDP_DEFAULT_MAX_SHARE)
        return (0, *[params // count + (1 if i < params % count else 0) for i in range(count)])

    def scaled(self, params: int) -> FsdpLayout:
        """The same layout for a model of ``params`` parameters (every group scaled alike)."""
        if not self.groups:
            return self
        total = sum(self.groups)
        sizes = [g * params // total for g in self.groups]
        sizes[max(range(len(sizes)), key=lambda i: self.groups[i])] += params - sum(sizes)
        return replace(self, groups=tuple(sizes))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One model's training step, per sample where it scales with the batch.

    Attributes are what a user can know or measure on one device; none is a multi-device result.
    """

    name: str
    params: int  # trainable parameters
    compute_s_per_sample: float  # forward + backward device seconds per sample (host overhead apart)
    backward_fraction: float = 2 / 3  # share of compute in backward (backward ~ 2x forward)
    input_bytes_per_sample: float = 0.0
    output_bytes_per_sample: float = 0.0  # what DataParallel gathers on the primary
    activation_bytes_per_sample: float = 0.0  # tensors saved for backward
    loss_on_replicas: bool = False  # True: the model returns its loss; gathered outputs get no gradient
    last_ready_params: int = 0  # parameters whose gradient is final only at the end of backward
    optimizer: str = "adam"
    precision: str = "fp32"
    optimizer_s: float | None = None  # measured optimizer step; None: from memory bandwidth
    counts: StepCounts = StepCounts()  # host work per step (zero: host overhead not modelled)
    fsdp: FsdpLayout = FsdpLayout()  # the fsdp strategy's groups and options

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise ConfigError(f"workload {self.name!r}: params={self.params} must be > 0")
        if self.compute_s_per_sample <= 0:
            raise ConfigError(
                f"workload {self.name!r}: compute_s_per_sample={self.compute_s_per_sample} must be > 0; "
                "measure it (multigpu advise --model module:factory) or pass --compute-per-sample"
            )
        if not 0 < self.backward_fraction < 1:
            raise ConfigError(f"backward_fraction={self.backward_fraction} must be in (0, 1), e.g. 2/3")
        if self.optimizer not in OPTIMIZER_TRAFFIC:
            raise ConfigError(f"optimizer={self.optimizer!r} is not one of {sorted(OPTIMIZER_TRAFFIC)}")
        if self.precision not in PRECISION_WEIGHT_BYTES:
            raise ConfigError(f"precision={self.precision!r} is not one of {sorted(PRECISION_WEIGHT_BYTES)}")
        if not 0 <= self.last_ready_params <= self.params:
            raise ConfigError(f"last_ready_params={self.last_ready_params} must be within [0, params={self.params}]")
        if self.fsdp.groups and sum(self.fsdp.groups) != self.params:
            raise ConfigError(
                f"workload {self.name!r}: fsdp groups hold {sum(self.fsdp.groups)} parameters, not params={self.params}; "
                "count them on the same model, or rescale them with FsdpLayout.scaled(params)"
            )

    @property
    def weight_bytes(self) -> int:
        """Bytes a parameter broadcast moves (fp32 weights)."""
        return self.params * 4

    @property
    def grad_bytes(self) -> int:
        """Bytes a gradient reduction moves (fp32 gradients)."""
        return self.params * 4

    def optimizer_traffic_bytes(self) -> int:
        return self.params * OPTIMIZER_TRAFFIC[self.optimizer]

    def with_compute(self, compute_s_per_sample: float) -> Workload:
        """The same workload at another per-sample compute time (another GPU)."""
        return replace(self, compute_s_per_sample=compute_s_per_sample)
