"""Built-in model presets: sizes and host counts a user can look up, and compute from FLOPs on a GPU.

FLOPs count two per multiply-accumulate, as torch's FlopCounterMode does, so a preset and a
measured model (``--model package.module:factory``) are on one scale. Per-sample compute on a GPU
(:func:`compute_s_per_sample`) is the step's FLOPs (forward + backward = 3x forward) over the
GPU's fp32 peak times :data:`FP32_UTILIZATION`; on Ampere and later PyTorch runs convolutions
in TF32 by default (``torch.backends.cudnn.allow_tf32 = True``), so their FLOPs go at the faster
of that and the TF32 tensor-core peak times :data:`TF32_UTILIZATION`. Pass ``--compute-ms`` when
you know your step's time.

Counts (modules, tensors, dispatched ops) were taken by :func:`multigpu.planning.counting.count_step`
on the meta device from equivalent module trees (``tests/planning/_reference_nets.py`` rebuilds
them and checks every number); Inception-v3's are estimated from its 96 conv-BN-ReLU units at
ResNet-50's counts per unit.

Example:
    >>> from multigpu.planning.hardware import gpu
    >>> w = workload("resnet50", gpu("v100-32gb"))
    >>> w.params, round(w.compute_s_per_sample * 32, 3)  # the PyTorch DDP benchmark measured 0.097 s
    (25557032, 0.1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from multigpu.errors import ConfigError
from multigpu.planning.counting import Counted
from multigpu.planning.hardware import GpuSpec
from multigpu.planning.workload import FsdpLayout, StepCounts, Workload

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


def counted_workload(
    counted: Counted, gpu: GpuSpec, *, name: str, utilization: float = FP32_UTILIZATION, optimizer: str = "adam"
) -> Workload:
    """The workload of a counted step (:func:`multigpu.planning.counting.count_step`) on ``gpu``."""
    b = counted.batch
    return Workload(
        name=name,
        params=counted.params,
        compute_s_per_sample=compute_s_per_sample(
            counted.flops / b, counted.conv_flops / counted.flops if counted.flops else 0.0, gpu, utilization
        ),
        input_bytes_per_sample=counted.input_bytes / b,
        output_bytes_per_sample=counted.output_bytes / b,
        activation_bytes_per_sample=counted.saved_bytes / b,
        optimizer=optimizer,
        counts=counted.counts,
    )


_SEQ, _VOCAB, _D, _LAYERS = 1024, 50257, 768, 12
_GPT2_EMBED = _VOCAB * _D  # tied with the LM head: its gradient completes at the embedding, last
# fsdp groups under the default rule (FSDPOptions(): a group holds 1-10% of the parameters), as
# multigpu.session.fsdp.select_blocks chooses them on the presets' module trees (tests check them
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
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} "
            "or pass an import path 'package.module:factory'"
        ) from None


def workload(
    name: str,
    gpu: GpuSpec,
    *,
    utilization: float = FP32_UTILIZATION,
    optimizer: str = "adam",
    input_shape: Sequence[int] | None = None,
) -> Workload:
    """The workload of preset ``name`` on ``gpu`` (at ``input_shape`` per sample, default the preset's)."""
    return preset(name).at_input_shape(input_shape).workload(gpu, utilization=utilization, optimizer=optimizer)
