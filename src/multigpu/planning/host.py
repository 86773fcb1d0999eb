"""The host's share of a step: Python, the dispatcher and kernel launches, and who waits for whom.

A step's host time is a sum of counts (:class:`~multigpu.planning.workload.StepCounts`) times
per-item costs (:class:`HostCosts`)::

    H_f = module_calls * t_call + forward_ops * t_op + forward_kernels * t_launch     (forward)
    H_b = backward_ops * t_bop + backward_kernels * t_launch                         (backward)
    R(N) = N * (modules * t_rmod + tensors * t_rten)                                 (replicate)
    H_fsdp = groups * t_group                                                        (fsdp's hooks)

A GPU runs the kernels while the host issues the next ones, so a phase takes the longer of the
two; a CPU runs each op on the thread that issued it, so the two add up (:func:`chain`).
DataParallel issues every replica's forward from one Python process: the threads take turns on
the GIL, and N of them need ``N * sigma * H_f`` (sigma >= 1 measured: turns are not free).
Backward runs in the autograd engine's C++ threads without the GIL, one per replica.

Constants: every ``t_*`` and sigma are measured on this machine by :mod:`multigpu.planning.calibrate`
(``python -m multigpu.planning.calibrate``); the GPU launch cost is cited (docs/planning.md).

Example:
    >>> from multigpu.planning.workload import StepCounts
    >>> host = HostCosts(op_s=1e-5, module_call_s=0.0, backward_op_s=1e-5, gil_contention=1.0,
    ...                  replicate_module_s=0.0, replicate_tensor_s=0.0)
    >>> round(forward_host_s(StepCounts(forward_ops=100, forward_kernels=100), host), 6)
    0.001
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from multigpu.errors import ConfigError
from multigpu.planning.workload import StepCounts

# Host-side cost of one CUDA kernel launch (driver and runtime calls before the GPU sees it).
# Public measurements: ~3 us per asynchronous empty-kernel launch (up to ~334,000 launches/s;
# University of Virginia, "CUDA Kernel Overhead", cs.virginia.edu/~mwb7w/cuda_support/kernel_overhead.html)
# and 4-6 us per submission on an RTX 5070 Ti with CUDA 13 (susun-blog.com, "pegainfer (3): From
# Launch Overhead to CUDA Graph"). The midpoint of the recent figure:
GPU_LAUNCH_S = 5e-6


# The per-event times of HostCosts, in seconds (validated together, printed by the calibration).
TIME_FIELDS = (
    "op_s",
    "module_call_s",
    "backward_op_s",
    "replicate_module_s",
    "replicate_tensor_s",
    "launch_s",
    "fsdp_group_s",
)


@dataclass(frozen=True, kw_only=True)
class HostCosts:
    """Seconds per item of host work (one thread, unless said otherwise)."""

    op_s: float  # one aten op called from Python (argument parsing, dispatcher, a tiny kernel)
    module_call_s: float  # one nn.Module call beyond its ops (hooks machinery, forward lookup)
    backward_op_s: float  # one node of backward in the autograd engine (C++, no GIL)
    gil_contention: float  # sigma: N threads issuing ops take sigma * N times as long as one thread
    replicate_module_s: float  # replicate: one module copied for one replica
    replicate_tensor_s: float  # replicate: one parameter or buffer handed to one replica
    launch_s: float = 0.0  # one kernel launch on a GPU (0 on CPU: the op is the kernel)
    # fsdp: FSDP2's Python per all-gather group and step (its forward and backward hooks, the
    # copies' bookkeeping, the optimizer on DTensors), beyond the model's own ops.
    fsdp_group_s: float = 0.0
    source: str = "measured"

    def __post_init__(self) -> None:
        for name in TIME_FIELDS:
            if getattr(self, name) < 0:
                raise ConfigError(f"HostCosts.{name}={getattr(self, name)} must be >= 0 seconds")
        if self.gil_contention <= 0:
            raise ConfigError(f"HostCosts.gil_contention={self.gil_contention} must be > 0 (1: threads serialise)")

    def on_gpu(self, launch_s: float = GPU_LAUNCH_S) -> HostCosts:
        """The same host driving a GPU: every kernel also pays a launch."""
        return replace(self, launch_s=launch_s)


# Measured on the development machine (AMD EPYC, 2 shared cores, torch 2.13 CPU build) with
# `python -m multigpu.planning.calibrate` (median of 12 runs over a morning, each the fastest of 7-15
# repeats; single runs ranged about 2x on this shared machine);
# replicate is torch.nn.parallel.replicate's, what nn.DataParallel runs on GPUs. A GPU server's
# host differs by tens of percent: calibrate there for precision.
DEFAULT_HOST = HostCosts(
    op_s=5.0e-6,
    module_call_s=1.6e-6,
    backward_op_s=7.0e-6,
    gil_contention=1.1,
    replicate_module_s=22e-6,
    replicate_tensor_s=5.0e-6,
    fsdp_group_s=740e-6,  # median of 12 probes (650-2170 us) of 16 groups, fastest of 15 each
    source="measured on the development machine (python -m multigpu.planning.calibrate)",
)


def forward_host_s(counts: StepCounts, host: HostCosts) -> float:
    """H_f: host seconds to issue one replica's forward and loss."""
    return (
        counts.module_calls * host.module_call_s
        + counts.forward_ops * host.op_s
        + counts.forward_kernels * host.launch_s
    )


def backward_host_s(counts: StepCounts, host: HostCosts) -> float:
    """H_b: host seconds to issue one replica's backward."""
    return counts.backward_ops * host.backward_op_s + counts.backward_kernels * host.launch_s


def replicate_s(counts: StepCounts, host: HostCosts, replicas: int) -> float:
    """R(N): Python work of DataParallel's replicate, every step, for ``replicas`` replicas."""
    return replicas * (counts.modules * host.replicate_module_s + counts.tensors * host.replicate_tensor_s)


def chain(host_s: float, device_s: float, *, synchronous: bool) -> float:
    """One thread issuing ops that take ``device_s`` to run: the sum on a CPU, the longer on a GPU."""
    return host_s + device_s if synchronous else max(host_s, device_s)


def threaded_forward_s(counts: StepCounts, host: HostCosts, replicas: int, one_replica_s: float) -> float:
    """Forward of ``replicas`` threads sharing one GIL: the slowest replica, or the GIL's queue of turns."""
    if replicas <= 1:
        return one_replica_s
    return max(one_replica_s, replicas * host.gil_contention * forward_host_s(counts, host))
