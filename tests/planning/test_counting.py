"""Counting a step on the meta device: FLOPs against analytic counts, ops, bytes, and the presets' numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from multigpu.errors import ConfigError
from multigpu.planning import workload
from multigpu.planning.counting import count_flops, count_step
from tests.planning import _reference_nets as nets


def _meta(build: object) -> nn.Module:
    with torch.device("meta"):
        return build()  # type: ignore[operator, no-any-return]


def _training_flops(convs: list[tuple[int, int, int, int, int]], batch: int) -> int:
    """Analytic forward + backward FLOPs of a conv stack whose input needs no gradient.

    Each conv's forward is 2 x MACs; its weight gradient and input gradient each cost the same
    (every input-weight-output product of the forward appears once in each), except the first
    conv's input gradient, which nothing needs.
    """
    forward = [2 * nets.conv_macs(*c) * batch for c in convs]
    return sum(forward) * 3 - forward[0]


def test_depthwise_block_backward_is_twice_its_forward_not_one_plus_groups() -> None:
    # MobileNetV2 inverted residual at 32 channels, expansion 6, 14x14: 1x1 expand, 3x3 depthwise, 1x1 project.
    block, x = _meta(nets.inverted_residual), torch.empty(4, 32, 14, 14, device="meta")
    convs = [(32, 192, 1, 1, 14), (192, 192, 3, 192, 14), (192, 32, 1, 1, 14)]
    assert count_flops(block, x) == _training_flops(convs, 4)


def test_grouped_resnext_block_matches_the_analytic_count() -> None:
    block, x = _meta(nets.resnext_block), torch.empty(2, 256, 14, 14, device="meta")
    convs = [(256, 128, 1, 1, 14), (128, 128, 3, 32, 14), (128, 256, 1, 1, 14)]
    assert count_flops(block, x) == _training_flops(convs, 2)


def test_torch_alone_overcounts_grouped_convolutions() -> None:
    # The reason for the correction: FlopCounterMode counts the depthwise weight gradient 192 times.
    block, x = _meta(nets.inverted_residual), torch.empty(4, 32, 14, 14, device="meta")
    counter = FlopCounterMode(display=False)
    with counter:
        block(x).square().mean().backward()
    assert counter.get_total_flops() > 2 * count_flops(block, x)


def test_linear_layer_counts_forward_and_weight_gradient() -> None:
    # forward x @ W^T and the weight gradient: two (32 x 64) @ (64 x 8) products, 2 FLOPs per MAC.
    assert count_flops(nn.Linear(64, 8, bias=False), torch.randn(32, 64)) == 2 * (2 * 32 * 64 * 8)


def test_counts_of_a_small_net_on_the_meta_device() -> None:
    net = _meta(lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)))
    counted = count_step(net, torch.empty(16, 64, device="meta"))
    assert counted.params == 64 * 32 + 32 + 32 * 8 + 8
    assert counted.counts.modules == 4 and counted.counts.tensors == 4 and counted.counts.module_calls == 4
    assert 0 < counted.counts.forward_kernels <= counted.counts.forward_ops
    assert 0 < counted.counts.backward_kernels <= counted.counts.backward_ops
    assert counted.input_bytes == 16 * 64 * 4 and counted.output_bytes == 16 * 8 * 4
    assert counted.saved_bytes >= 16 * 32 * 4  # the hidden activation, at least once
    assert counted.conv_flops == 0


def test_embedding_model_counts_with_token_ids() -> None:
    net = _meta(lambda: nn.Sequential(nn.Embedding(1000, 16), nn.Flatten(), nn.Linear(16 * 12, 4)))
    counted = count_step(net, torch.zeros(8, 12, dtype=torch.long, device="meta"))
    assert counted.input_bytes == 8 * 12 * 8 and counted.params == 1000 * 16 + 16 * 12 * 4 + 4


def test_a_model_that_cannot_run_says_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"counting one step of Linear failed: .*pass --compute-ms"):
        count_step(_meta(lambda: nn.Linear(4, 2)), torch.empty(3, 5, device="meta"))


@pytest.mark.parametrize(
    ("preset", "build", "shape", "dtype"),
    [
        ("resnet50", nets.resnet50, (3, 224, 224), torch.float32),
        ("resnet101", nets.resnet101, (3, 224, 224), torch.float32),
        ("vgg16", nets.vgg16, (3, 224, 224), torch.float32),
        ("gpt2-124m", nets.GPT2, (1024,), torch.long),
    ],
)
def test_preset_numbers_are_the_counts_of_an_equivalent_tree(
    preset: str, build: object, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    spec = workload.preset(preset)
    net = _meta(build)
    x = torch.zeros(2, *shape, dtype=dtype, device="meta")
    counted = count_step(net, x)
    assert counted.params == spec.params
    assert counted.counts == spec.counts
    # The presets' training FLOPs (3x forward of the papers' figures) agree with the count: within
    # 3% for the CNNs (MACs x 2); GPT-2's formula counts attention once per token (Kaplan et al.
    # 2020), the counter counts QK^T and AV apart: 7% more.
    assert counted.flops / 2 == pytest.approx(3 * spec.forward_flops, rel=0.08 if preset == "gpt2-124m" else 0.03)
    assert counted.conv_flops / counted.flops == pytest.approx(spec.conv_share, abs=0.01)


def test_the_measured_optimizer_step_follows_a_backward_each_time_as_in_training() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from multigpu.planning.counting import measure_workload

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    stale: list[bool] = []  # per step: whether its gradient was stepped on before

    def mark(opt: torch.optim.Optimizer, *_: object) -> None:
        grad = opt.param_groups[0]["params"][0].grad
        stale.append(hasattr(grad, "stepped_on"))
        grad.stepped_on = True  # type: ignore[union-attr]

    hook = register_optimizer_step_pre_hook(mark)
    try:
        w = measure_workload(model, torch.randn(8, 16), repeats=3)
    finally:
        hook.remove()
    # each step on the fresh gradients of its own backward, as a training step runs it (one set of
    # gradients stepped on again and again reads the weights and the optimizer's state warm)
    assert stale == [False] * 4
    assert w.optimizer_s is not None and w.optimizer_s > 0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("measure", ["count_step", "measure_workload"])
def test_counting_or_timing_a_real_model_leaves_it_and_the_random_streams_as_they_were(measure: str) -> None:
    # both run the user's model for real when it is not on the meta device: the timed optimizer steps moved its
    # weights, its BatchNorm's running statistics counted the probe's batches, its dropout drew from the
    # process's stream, and the gradients it held were dropped
    from multigpu.planning.counting import measure_workload

    # (and the probe's first backward added into the gradients held, in place: the same tensors, other values)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model(torch.randn(4, 8)).sum().backward()
    model[2].eval()  # one module in eval mode, the rest training
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad for p in model.parameters()]
    grad_values = [g.clone() for g in grads]
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    x = torch.randn(16, 8)
    torch.set_rng_state(rng)
    if measure == "count_step":
        count_step(model, x)
    else:
        measure_workload(model, x, repeats=2)
    after = model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(g, v) for g, v in zip(grads, grad_values))
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)


class _DrawsFromPythonAndNumpy(nn.Module):
    """Stochastic depth drawn from Python's and numpy's streams, as some models' forwards do."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        keep = random.random() < 0.9 and np.random.rand() < 0.9
        return self.layer(x) if keep else self.layer(x) * 0.5


@pytest.mark.parametrize("measure", ["count_step", "measure_workload", "calibrate_cpu"])
def test_the_probe_leaves_pythons_and_numpys_random_streams_as_they_were(measure: str) -> None:
    # left_as_found put back torch's streams only: a model drawing from Python's or numpy's (stochastic depth,
    # augmentation inside the model) trained on another stream than its seed gives after advise timed it
    import random

    import numpy as np

    from multigpu.planning.counting import measure_workload
    from multigpu.planning.cpu_plan import CpuBatches, calibrate_cpu
    from tests.planning.machine_constants import fixed

    model, x = _DrawsFromPythonAndNumpy(), torch.randn(4, 8)
    random.seed(1)
    np.random.seed(1)
    python, numpy_state = random.getstate(), np.random.get_state()
    if measure == "count_step":
        count_step(model, x)
    elif measure == "measure_workload":
        measure_workload(model, x, repeats=2)
    else:
        calibrate_cpu(model, lambda n: torch.randn(n, 8), CpuBatches(4, 2, 2), fixed(), cores=2)
    assert random.getstate() == python
    after = np.random.get_state()
    assert after[0] == numpy_state[0] and np.array_equal(after[1], numpy_state[1]) and after[2:] == numpy_state[2:]


def test_a_model_with_nothing_to_train_is_refused_naming_it() -> None:
    # every parameter frozen: the backward failed and the refusal spoke of meta kernels
    model = nn.Linear(4, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match=r"Linear has no parameter that requires a gradient.*unfreeze"):
        count_step(model, torch.randn(3, 4))
