"""The host's share of a step: equations, and the calibration that measures their constants."""

from __future__ import annotations

import pytest

from multigpu.errors import ConfigError
from multigpu.planning import costs, hardware
from multigpu.planning.calibrate import measure_host_costs
from multigpu.planning.workload import StepCounts

COSTS = hardware.HostCosts(
    op_s=4e-6,
    module_call_s=2e-6,
    backward_op_s=6e-6,
    gil_contention=1.5,
    replicate_module_s=20e-6,
    replicate_tensor_s=5e-6,
    launch_s=5e-6,
)
COUNTS = StepCounts(
    modules=10, tensors=20, module_calls=12, forward_ops=100, backward_ops=150, forward_kernels=80, backward_kernels=90
)


def test_host_seconds_are_counts_times_costs() -> None:
    assert costs.forward_host_s(COUNTS, COSTS) == pytest.approx(12 * 2e-6 + 100 * 4e-6 + 80 * 5e-6)
    assert costs.backward_host_s(COUNTS, COSTS) == pytest.approx(150 * 6e-6 + 90 * 5e-6)
    assert costs.replicate_s(COUNTS, COSTS, 3) == pytest.approx(3 * (10 * 20e-6 + 20 * 5e-6))


def test_chain_adds_on_cpu_and_overlaps_on_gpu() -> None:
    assert costs.chain(2.0, 3.0, synchronous=True) == 5.0
    assert costs.chain(2.0, 3.0, synchronous=False) == 3.0


def test_threads_queue_on_the_gil_only_past_one_replica() -> None:
    h_f = costs.forward_host_s(COUNTS, COSTS)
    assert costs.threaded_forward_s(COUNTS, COSTS, 1, 1e-9) == 1e-9
    assert costs.threaded_forward_s(COUNTS, COSTS, 4, 1e-9) == pytest.approx(4 * 1.5 * h_f)
    assert costs.threaded_forward_s(COUNTS, COSTS, 4, 1.0) == 1.0  # a long device forward hides the queue


def test_gpu_costs_add_the_cited_launch() -> None:
    cpu = hardware.DEFAULT_HOST
    assert cpu.launch_s == 0.0 and cpu.on_gpu().launch_s == hardware.GPU_LAUNCH_S


def test_bad_costs_are_refused() -> None:
    for op_s in (-1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=rf"HostCosts.op_s={op_s} must be a finite number >= 0"):
            hardware.HostCosts(
                op_s=op_s,
                module_call_s=0,
                backward_op_s=0,
                gil_contention=1,
                replicate_module_s=0,
                replicate_tensor_s=0,
            )
    with pytest.raises(ConfigError, match=r"StepCounts.forward_ops=-2 must be >= 0"):
        StepCounts(forward_ops=-2)
    with pytest.raises(ConfigError, match=r"kernels \(5 forward, 0 backward\) cannot exceed"):
        StepCounts(forward_ops=3, forward_kernels=5)


@pytest.mark.parametrize("replicate", ["multigpu", "torch"])
def test_calibration_measures_every_constant(replicate: str) -> None:
    costs = measure_host_costs(items=200, repeats=2, replicate=replicate)
    for name in ("op_s", "module_call_s", "replicate_module_s", "gil_contention"):
        assert getattr(costs, name) > 0, name
    assert costs.backward_op_s >= 0 and costs.replicate_tensor_s >= 0 and costs.launch_s == 0


def test_calibration_names_the_replicates_it_knows() -> None:
    with pytest.raises(ConfigError, match=r"replicate='jax' is not one of 'torch'"):
        measure_host_costs(items=10, repeats=1, replicate="jax")
