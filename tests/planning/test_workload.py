"""Presets: input-shape rescaling, FLOPs to time (fp32, and TF32 convolutions on Ampere and later)."""

from __future__ import annotations

import pytest

from multigpu.errors import ConfigError
from multigpu.planning import hardware, workload


def test_input_shape_rescales_compute_activations_and_inputs_not_the_classes() -> None:
    base = workload.preset("resnet50")
    small = base.at_input_shape((3, 32, 32))
    scale = 32 * 32 / (224 * 224)
    assert small.forward_flops == pytest.approx(base.forward_flops * scale)
    assert small.activation_bytes == pytest.approx(base.activation_bytes * scale)
    assert small.input_bytes == pytest.approx(3 * 32 * 32 * 4)
    assert small.output_bytes == base.output_bytes  # 1000 logits whatever the image
    assert small.counts == base.counts  # the same ops, on smaller tensors


def test_token_models_rescale_their_outputs_with_the_sequence() -> None:
    gpt2 = workload.preset("gpt2-124m")
    assert gpt2.at_input_shape((512,)).output_bytes == pytest.approx(gpt2.output_bytes / 2)


def test_a_shape_of_the_wrong_rank_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"--input-shape 32,32 does not fit preset 'resnet50', whose samples are 3,224,224"
    ):
        workload.preset("resnet50").at_input_shape((32, 32))


def test_convolutions_use_tf32_where_pytorch_does() -> None:
    flops = 24.5e9
    a100, v100 = hardware.gpu("a100-80gb"), hardware.gpu("v100")
    # A100: convolutions at 15% of 156 TFLOPS (TF32) beat 50% of 19.5 (fp32); matmuls stay fp32.
    assert workload.compute_s_per_sample(flops, 1.0, a100) == pytest.approx(
        flops / (156e12 * workload.TF32_UTILIZATION)
    )
    assert workload.compute_s_per_sample(flops, 0.0, a100) == pytest.approx(flops / (19.5e12 * 0.5))
    assert workload.compute_s_per_sample(flops, 1.0, v100) == pytest.approx(flops / (15.7e12 * 0.5))


def test_resnet50_compute_matches_the_public_single_gpu_runs() -> None:
    # Inputs to the model, not answers it fits: PyTorch's DDP benchmark (V100, 0.097 s per 32) and
    # NVIDIA's DeepLearningExamples (A100 TF32, 938 img/s) set the two utilisations.
    assert 32 * workload.from_preset("resnet50", hardware.gpu("v100-32gb")).compute_s_per_sample == pytest.approx(
        0.097, rel=0.05
    )
    assert 1 / workload.from_preset("resnet50", hardware.gpu("a100-80gb")).compute_s_per_sample == pytest.approx(
        938, rel=0.05
    )


def test_utilization_must_be_a_share() -> None:
    with pytest.raises(ConfigError, match=r"--utilization 1.5 must be in \(0, 1\]"):
        workload.from_preset("resnet50", hardware.gpu("t4"), utilization=1.5)
