"""What is trained: the numbers the time and memory models need from a model and its step, and presets.

A :class:`Workload` comes from counting a model's step on the meta device or timing it on this
CPU (:mod:`multigpu.planning.counting`), from a built-in preset (:data:`PRESETS`, sizes and host
counts a user can look up), or from flags. Its :class:`StepCounts` are what the host (Python, the
dispatcher, kernel launches) pays per step, whatever the batch; its :class:`FsdpLayout`, how the
fsdp strategy groups its parameters.

FLOPs count two per multiply-accumulate, as torch's FlopCounterMode does, so a preset and a
measured model (``--model package.module:factory``) are on one scale. Per-sample compute on a GPU
(:func:`compute_s_per_sample`) is the step's FLOPs (forward + backward = 3x forward) over the
GPU's fp32 peak times :data:`FP32_UTILIZATION`; on Ampere and later PyTorch runs convolutions
in TF32 by default (``torch.backends.cudnn.allow_tf32 = True``), so their FLOPs go at the faster
of that and the TF32 tensor-core peak times :data:`TF32_UTILIZATION`. Pass ``--compute-ms`` when
you know your step's time. The presets' counts (modules, tensors, dispatched ops) were taken by
:func:`multigpu.planning.counting.count_step` on the meta device from equivalent module trees
(``tests/planning/_reference_nets.py`` rebuilds them and checks every number); Inception-v3's
are estimated from its 96 conv-BN-ReLU units at ResNet-50's counts per unit.

Example:
    >>> Workload(name="mlp", params=2_000_000, compute_s_per_sample=1e-4).grad_bytes
    8000000
    >>> from multigpu.planning.hardware import gpu
    >>> w = from_preset("resnet50", gpu("v100-32gb"))
    >>> w.params, round(w.compute_s_per_sample * 32, 3)  # the PyTorch DDP benchmark measured 0.097 s
    (25557032, 0.1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from multigpu.core.lookup import lookup
from multigpu.errors import ConfigError
from multigpu.planning.hardware import GpuSpec

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
    buffer_bytes: float = 0.0  # the model's buffers (BatchNorm's running statistics): DDP broadcasts them each forward
    # CPU: one replica's step's allocations at or above fsdp's mmap threshold (measured at the
    # replica's batch: the count per step, the bytes per sample); 0: not counted
    large_allocations: int = 0
    large_allocation_bytes_per_sample: float = 0.0
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
                "measure it (multigpu advise --model module:factory) or pass --compute-ms"
            )
        if not 0 < self.backward_fraction < 1:
            raise ConfigError(f"backward_fraction={self.backward_fraction} must be in (0, 1), e.g. 2/3")
        for name, table in (("optimizer", OPTIMIZER_TRAFFIC), ("precision", PRECISION_WEIGHT_BYTES)):
            message = "{name}={value!r} is not one of {choices}; pass one of them (--{name})"
            lookup(table, getattr(self, name), message, choices=sorted(table), name=name)
        if self.large_allocations < 0 or self.large_allocation_bytes_per_sample < 0:
            raise ConfigError(
                f"large_allocations={self.large_allocations}, large_allocation_bytes_per_sample="
                f"{self.large_allocation_bytes_per_sample} must be >= 0 (a count, bytes)"
            )
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


# Share of the fp32 peak a training step reaches. ResNet-50 at batch 32 on a V100 (15.7 TFLOPS)
# takes 0.097 s for 32 x 24.5 GFLOP: 51% (PyTorch benchmarks/distributed/ddp); NVIDIA's
# DeepLearningExamples measure 367 img/s in FP32 on a V100 16 GB: 57%. Pass measured compute to replace it.
FP32_UTILIZATION = 0.5
# Share of the TF32 tensor-core peak convolutions reach: NVIDIA DeepLearningExamples, ResNet-50
# v1.5 PyTorch, one A100 80 GB in TF32: 938 img/s x 24.3 GFLOP = 22.8 TFLOPS of 156: 15%.
TF32_UTILIZATION = 0.15


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """Sizes of a well-known model, per sample (one sequence or one image) at ``input_shape``."""

    name: str
    params: int
    forward_flops: float  # per sample, 2 per multiply-accumulate
    conv_share: float  # share of the FLOPs in convolutions (TF32 on Ampere and later)
    input_shape: tuple[int, ...]  # per sample; --input-shape rescales the per-sample sizes
    input_bytes: float
    output_bytes: float
    activation_bytes: float  # saved for backward, fp32
    loss_on_replicas: bool  # the model returns its own loss (Hugging Face style)
    last_ready_params: int  # parameters whose gradient is final only at the end of backward
    counts: StepCounts
    outputs_scale: bool = False  # outputs grow with the input (per-token logits), not fixed (classes)
    fsdp_groups: tuple[int, ...] = ()  # fsdp's default grouping rule on the module tree: root's group first
    source: str

    def at_input_shape(self, shape: Sequence[int] | None) -> ModelPreset:
        """The preset at another per-sample input shape: compute, activations and inputs scale with its size.

        Raises:
            ConfigError: a shape of another rank than the preset's (e.g. 32,32 for an image model).
        """
        if shape is None or tuple(shape) == self.input_shape:
            return self
        if len(shape) != len(self.input_shape) or min(shape) < 1:
            raise ConfigError(
                f"--input-shape {','.join(map(str, shape))} does not fit preset {self.name!r}, whose samples "
                f"are {','.join(map(str, self.input_shape))}; pass {len(self.input_shape)} positive sizes"
            )
        scale = math.prod(shape) / math.prod(self.input_shape)
        return replace(
            self,
            input_shape=tuple(shape),
            forward_flops=self.forward_flops * scale,
            input_bytes=self.input_bytes * scale,
            activation_bytes=self.activation_bytes * scale,
            output_bytes=self.output_bytes * (scale if self.outputs_scale else 1.0),
        )

    def workload(self, gpu: GpuSpec, *, utilization: float = FP32_UTILIZATION, optimizer: str = "adam") -> Workload:
        return Workload(
            name=self.name,
            params=self.params,
            compute_s_per_sample=compute_s_per_sample(3 * self.forward_flops, self.conv_share, gpu, utilization),
            input_bytes_per_sample=self.input_bytes,
            output_bytes_per_sample=self.output_bytes,
            activation_bytes_per_sample=self.activation_bytes,
            loss_on_replicas=self.loss_on_replicas,
            last_ready_params=self.last_ready_params,
            optimizer=optimizer,
            counts=self.counts,
            fsdp=FsdpLayout(groups=self.fsdp_groups),
        )


def compute_s_per_sample(flops: float, conv_share: float, gpu: GpuSpec, utilization: float = FP32_UTILIZATION) -> float:
    """Seconds of ``flops`` (one sample's forward + backward) on ``gpu``.

    Convolutions run at the faster of fp32 and TF32 (where the GPU has TF32 and PyTorch uses it by
    default); everything else at fp32 (``torch.backends.cuda.matmul.allow_tf32`` is False by default).
    """
    if not 0 < utilization <= 1:
        raise ConfigError(f"--utilization {utilization} must be in (0, 1]: the share of the fp32 peak reached")
    fp32 = gpu.fp32_flops * utilization
    conv = max(fp32, (gpu.tf32_flops or 0.0) * TF32_UTILIZATION)
    return flops * conv_share / conv + flops * (1 - conv_share) / fp32


_SEQ, _VOCAB, _D, _LAYERS = 1024, 50257, 768, 12
_GPT2_EMBED = _VOCAB * _D  # tied with the LM head: its gradient completes at the embedding, last
# fsdp groups under the default rule (FSDPOptions(): a group holds 1-10% of the parameters), as
# multigpu.strategies.fsdp.select_blocks chooses them on the presets' module trees (tests check them
# on equivalent trees). GPT-2: every block; the tied embedding/LM head is shared, so it stays with
# the root (with wpe and ln_f). ResNets: layer2, then each block of layer3, each conv/downsample of
# layer4's first block... (anything above 10% is split into its children), and fc; the root keeps
# conv1, layer1 and the BatchNorms. VGG-16: the large convolutions and each classifier Linear.
_GPT2_FSDP = (_GPT2_EMBED + _SEQ * _D + 2 * _D, *[7_087_872] * _LAYERS)
_LAYER4_FSDP = (524_288, 2_359_296, 1_048_576, 2_101_248, *[1_048_576, 2_359_296, 1_048_576] * 2)
_RESNET_FSDP = {
    "resnet50": (243_776, 1_219_584, 1_512_448, *[1_117_184] * 5, *_LAYER4_FSDP, 2_049_000),
    "resnet101": (243_776, 1_219_584, 1_512_448, *[1_117_184] * 22, *_LAYER4_FSDP, 2_049_000),
}
_VGG16_FSDP = (2_915_648, *[2_359_808] * 5, 102_764_544, 16_781_312, 4_097_000)
_IMAGE = (3, 224, 224)
_IMAGE_BYTES = 3 * 224 * 224 * 4
_COUNTED = "counted on the meta device from an equivalent module tree"

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="gpt2-124m",
            params=124_439_808,
            # Per token: 2*(non-embedding params) + 2*d*vocab (LM head) + 2*layers*seq*d (attention).
            forward_flops=_SEQ * (2 * 85_054_464 + 2 * _D * _VOCAB + 2 * _LAYERS * _SEQ * _D),
            conv_share=0.0,
            input_shape=(_SEQ,),
            input_bytes=_SEQ * 8 * 2,  # input ids and labels, int64
            # Hugging Face GPT2LMHeadModel returns fp32 logits and (use_cache=True) every layer's keys/values.
            output_bytes=_SEQ * _VOCAB * 4 + _LAYERS * 2 * _SEQ * _D * 4,
            activation_bytes=_LAYERS * _SEQ * _D * (34 + 5 * 12 * _SEQ / _D) * 2 + 2 * _SEQ * _VOCAB * 4,
            loss_on_replicas=True,
            last_ready_params=_GPT2_EMBED,
            counts=StepCounts(
                modules=114,
                tensors=148,
                module_calls=125,
                forward_ops=783,
                backward_ops=1105,
                forward_kernels=444,
                backward_kernels=409,
            ),
            outputs_scale=True,
            fsdp_groups=_GPT2_FSDP,
            source=f"GPT-2 small, sequence 1024 (HF transformers GPT2Config); activations per Korthikanti et al. 2022, x2 for fp32; ops {_COUNTED}",
        ),
        ModelPreset(
            name="resnet50",
            params=25_557_032,
            forward_flops=8.18e9,
            conv_share=0.999,
            input_shape=_IMAGE,
            input_bytes=_IMAGE_BYTES,
            output_bytes=1000 * 4,
            activation_bytes=85.4e6,
            loss_on_replicas=False,
            last_ready_params=9_536,  # conv1 (+ bn1) only
            counts=StepCounts(
                modules=151,
                tensors=320,
                module_calls=183,
                forward_ops=284,
                backward_ops=399,
                forward_kernels=229,
                backward_kernels=181,
            ),
            fsdp_groups=_RESNET_FSDP["resnet50"],
            source=f"torchvision resnet50, 224x224; 4.09 GMACs (torchvision docs); activations and ops {_COUNTED}",
        ),
        ModelPreset(
            name="resnet101",
            params=44_549_160,
            forward_flops=15.6e9,
            conv_share=1.0,
            input_shape=_IMAGE,
            input_bytes=_IMAGE_BYTES,
            output_bytes=1000 * 4,
            activation_bytes=126.5e6,
            loss_on_replicas=False,
            last_ready_params=9_536,
            counts=StepCounts(
                modules=287,
                tensors=626,
                module_calls=353,
                forward_ops=556,
                backward_ops=773,
                forward_kernels=450,
                backward_kernels=351,
            ),
            fsdp_groups=_RESNET_FSDP["resnet101"],
            source=f"torchvision resnet101, 224x224; 7.80 GMACs (torchvision docs); activations and ops {_COUNTED}",
        ),
        ModelPreset(
            name="inception-v3",
            params=23_834_568,
            forward_flops=11.46e9,
            conv_share=0.999,
            input_shape=(3, 299, 299),
            input_bytes=3 * 299 * 299 * 4,
            output_bytes=1000 * 4,
            activation_bytes=120e6,
            loss_on_replicas=False,
            last_ready_params=864,
            counts=StepCounts(
                modules=274,
                tensors=580,
                module_calls=331,
                forward_ops=514,
                backward_ops=723,
                forward_kernels=415,
                backward_kernels=328,
            ),
            source="torchvision inception_v3, 299x299; 5.73 GMACs (torchvision docs); activations rough (+-30%), ops estimated",
        ),
        ModelPreset(
            name="vgg16",
            params=138_357_544,
            forward_flops=30.9e9,
            conv_share=0.992,
            input_shape=_IMAGE,
            input_bytes=_IMAGE_BYTES,
            output_bytes=1000 * 4,
            activation_bytes=72.8e6,
            loss_on_replicas=False,
            last_ready_params=1_792,
            counts=StepCounts(
                modules=43,
                tensors=32,
                module_calls=43,
                forward_ops=51,
                backward_ops=114,
                forward_kernels=45,
                backward_kernels=50,
            ),
            fsdp_groups=_VGG16_FSDP,
            source=f"torchvision vgg16, 224x224; 15.47 GMACs (torchvision docs); activations and ops {_COUNTED}",
        ),
    )
}


def preset(name: str) -> ModelPreset:
    """The model preset called ``name``.

    Raises:
        ConfigError: an unknown name; the message lists the presets.
    """
    message = "unknown model preset {value!r}; choose one of {choices} or pass an import path 'package.module:factory'"
    return lookup(PRESETS, name.lower(), message, shown=name)


def from_preset(
    name: str,
    gpu: GpuSpec,
    *,
    utilization: float = FP32_UTILIZATION,
    optimizer: str = "adam",
    input_shape: Sequence[int] | None = None,
) -> Workload:
    """The workload of preset ``name`` on ``gpu`` (at ``input_shape`` per sample, default the preset's)."""
    return preset(name).at_input_shape(input_shape).workload(gpu, utilization=utilization, optimizer=optimizer)
