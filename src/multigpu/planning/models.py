"""Built-in model presets: sizes a user can look up, and compute from FLOPs on a given GPU.

Per-sample compute on a GPU = FLOPs per sample (forward + backward = 3x forward) divided by the
GPU's fp32 peak times :data:`FP32_UTILIZATION`. Measure your own model instead
(``multigpu advise --model module:factory``) or pass ``--compute-per-sample`` when you know it.

Example:
    >>> from multigpu.planning.hardware import gpu
    >>> w = workload("resnet50", gpu("v100-32gb"))
    >>> w.params
    25557032
"""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.errors import ConfigError
from multigpu.planning.hardware import GpuSpec
from multigpu.planning.workload import Workload

# Share of fp32 peak a training step reaches. An assumption, of the order seen in public runs:
# ResNet-50 at batch 32 on a V100 (15.7 TFLOPS) takes 0.097 s for 32 x 12.3 GFLOP = 26% of peak
# (PyTorch benchmarks/distributed/ddp). Pass measured compute to replace it.
FP32_UTILIZATION = 0.3


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """Sizes of a well-known model, per sample (one sequence or one image)."""

    name: str
    params: int
    forward_flops: float  # per sample
    input_bytes: float
    output_bytes: float
    activation_bytes: float  # saved for backward, fp32 (rough: +-30%)
    loss_on_replicas: bool  # the model returns its own loss (Hugging Face style)
    last_ready_params: int  # parameters whose gradient is final only at the end of backward
    source: str

    def workload(self, gpu: GpuSpec, *, utilization: float = FP32_UTILIZATION, optimizer: str = "adam") -> Workload:
        return Workload(
            name=self.name,
            params=self.params,
            compute_s_per_sample=3 * self.forward_flops / (gpu.fp32_flops * utilization),
            input_bytes_per_sample=self.input_bytes,
            output_bytes_per_sample=self.output_bytes,
            activation_bytes_per_sample=self.activation_bytes,
            loss_on_replicas=self.loss_on_replicas,
            last_ready_params=self.last_ready_params,
            optimizer=optimizer,
        )


_SEQ, _VOCAB, _D, _LAYERS = 1024, 50257, 768, 12
_GPT2_EMBED = _VOCAB * _D  # tied with the LM head: its gradient completes at the embedding, last
_IMAGE = 3 * 224 * 224 * 4

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="gpt2-124m",
            params=124_439_808,
            # Per token: 2*(non-embedding params) + 2*d*vocab (LM head) + 2*layers*seq*d (attention).
            forward_flops=_SEQ * (2 * 85_054_464 + 2 * _D * _VOCAB + 2 * _LAYERS * _SEQ * _D),
            input_bytes=_SEQ * 8 * 2,  # input ids and labels, int64
            # Hugging Face GPT2LMHeadModel returns fp32 logits and (use_cache=True) every layer's keys/values.
            output_bytes=_SEQ * _VOCAB * 4 + _LAYERS * 2 * _SEQ * _D * 4,
            activation_bytes=_LAYERS * _SEQ * _D * (34 + 5 * 12 * _SEQ / _D) * 2 + 2 * _SEQ * _VOCAB * 4,
            loss_on_replicas=True,
            last_ready_params=_GPT2_EMBED,
            source="GPT-2 small, sequence 1024 (HF transformers GPT2Config); activations per Korthikanti et al. 2022, x2 for fp32",
        ),
        ModelPreset(
            name="resnet50",
            params=25_557_032,
            forward_flops=4.1e9,
            input_bytes=_IMAGE,
            output_bytes=1000 * 4,
            activation_bytes=100e6,
            loss_on_replicas=False,
            last_ready_params=9_536,  # conv1 (+ bn1) only
            source="torchvision resnet50, 224x224; 4.1 GFLOPs (He et al. 2016)",
        ),
        ModelPreset(
            name="resnet101",
            params=44_549_160,
            forward_flops=7.8e9,
            input_bytes=_IMAGE,
            output_bytes=1000 * 4,
            activation_bytes=150e6,
            loss_on_replicas=False,
            last_ready_params=9_536,
            source="torchvision resnet101, 224x224; 7.8 GFLOPs (He et al. 2016)",
        ),
        ModelPreset(
            name="inception-v3",
            params=23_834_568,
            forward_flops=5.7e9,
            input_bytes=3 * 299 * 299 * 4,
            output_bytes=1000 * 4,
            activation_bytes=120e6,
            loss_on_replicas=False,
            last_ready_params=864,
            source="torchvision inception_v3, 299x299; 5.7 GFLOPs (Szegedy et al. 2016)",
        ),
        ModelPreset(
            name="vgg16",
            params=138_357_544,
            forward_flops=15.5e9,
            input_bytes=_IMAGE,
            output_bytes=1000 * 4,
            activation_bytes=110e6,
            loss_on_replicas=False,
            last_ready_params=1_792,
            source="torchvision vgg16, 224x224; 15.5 GFLOPs (Simonyan & Zisserman 2015)",
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


def workload(name: str, gpu: GpuSpec, *, utilization: float = FP32_UTILIZATION, optimizer: str = "adam") -> Workload:
    """The workload of preset ``name`` on ``gpu``."""
    return preset(name).workload(gpu, utilization=utilization, optimizer=optimizer)
