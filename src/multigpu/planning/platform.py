"""Where a workload runs: the devices' memory and bandwidth, the link, and how replicas share.

:func:`gpu_platform` builds one from presets (:mod:`multigpu.planning.hardware`); a CPU platform
comes from quick measurements of this machine (:func:`multigpu.planning.measure.measure_cpu_platform`).

Example:
    >>> from multigpu.planning.hardware import gpu, link
    >>> p = gpu_platform(gpu("v100-32gb"), link("nvlink-v100"))
    >>> p.compute_slowdown(8)
    1.0
"""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.errors import ConfigError
from multigpu.planning.hardware import GpuSpec, LinkSpec, link
from multigpu.planning.host import DEFAULT_HOST, HostCosts

# Share of the communication that *could* hide behind backward (bucketed all-reduce) that does.
# 1 would be the ideal of the DDP design; published end-to-end runs hide less (comm kernels
# compete with compute for SMs and memory bandwidth). 0.5 is the neutral midpoint; the
# validation holds for every value in [0, 0.75] (tests/planning/test_cases.py sweeps it).
DEFAULT_GPU_OVERLAP = 0.5
# Per replica and per phase (forward, backward): handing work to a pool thread and collecting it.
DEFAULT_THREAD_OVERHEAD_S = 1e-4
# Host -> device copies from pageable memory are staged through a pinned buffer by the driver:
# 4.5 GB/s pageable vs 5.9 GB/s pinned measured on PCIe x16 Gen2 (J. Habich, "PCI express pinned
# host memory", 2009). A DataLoader without pin_memory=True hands the step pageable tensors.
PAGEABLE_FRACTION = 4.5 / 5.9


@dataclass(frozen=True, kw_only=True)
class Platform:
    """One kind of device, the link between devices and, for clusters, the network between nodes."""

    name: str
    memory_bytes: float | None  # per device; None: no limit is checked
    memory_bandwidth: float  # bytes/s, for optimizer steps and DDP bucket copies
    link: LinkSpec  # between devices of one node
    host_bandwidth: float | None = None  # bytes/s host -> device from pinned memory; None: inputs already there
    pinned: bool = False  # inputs in pinned memory (DataLoader(pin_memory=True)); else pageable copies
    peer_copies: bool = True  # False: replicas share memory (CPU) and DataParallel copies are free
    overlap: float = DEFAULT_GPU_OVERLAP  # share of hideable all-reduce that hides behind backward
    cores: int | None = None  # CPU: cores the replicas share; None: each device computes alone
    contention: float = 1.0  # slowdown of each replica while ``cores`` replicas run at once (measured)
    thread_overhead_s: float = DEFAULT_THREAD_OVERHEAD_S
    host: HostCosts = DEFAULT_HOST  # Python, dispatcher and launch costs of the host driving the devices
    synchronous: bool = False  # True on CPU: an op runs on the thread that issues it (host and compute add up)
    context_bytes: float = 0.0  # per process (CUDA context)
    devices_per_node: int | None = None  # None: one node holds every device
    network: LinkSpec | None = None  # between nodes
    # Bus bandwidth of all-gather and reduce-scatter (fsdp); None: the all-reduce's. nccl-tests
    # defines busbw so that one link gives every ring collective the same; gloo's all-gather and
    # reduce-scatter run slower than its all-reduce, so a CPU platform measures them.
    gather_busbw: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap <= 1.0:
            raise ConfigError(f"overlap={self.overlap} must be within [0, 1] (share of all-reduce hidden)")
        if self.contention < 1.0:
            raise ConfigError(f"contention={self.contention} must be >= 1 (a slowdown factor)")
        if self.memory_bandwidth <= 0:
            raise ConfigError(f"memory_bandwidth={self.memory_bandwidth} must be > 0 bytes/s")
        if self.gather_busbw is not None and self.gather_busbw <= 0:
            raise ConfigError(f"gather_busbw={self.gather_busbw} must be > 0 bytes/s (or None: the all-reduce's)")
        if self.devices_per_node is not None and self.network is None:
            raise ConfigError("devices_per_node is set but no network links the nodes; pass network=link('ib-hdr')")

    def input_bandwidth(self) -> float | None:
        """Bytes/s of the host -> device copy of a batch (pageable copies are slower)."""
        if self.host_bandwidth is None:
            return None
        return self.host_bandwidth * (1.0 if self.pinned else PAGEABLE_FRACTION)

    def compute_slowdown(self, replicas: int) -> float:
        """How much slower each replica computes while ``replicas`` run at once (1 on GPUs)."""
        if self.cores is None or replicas <= 1:
            return 1.0
        return self.contention * max(1.0, replicas / self.cores)

    def allreduce_busbw(self, devices: int) -> float:
        """Bus bandwidth of a ring over ``devices``: the slowest hop (the network, across nodes)."""
        if self.network is not None and self.devices_per_node is not None and devices > self.devices_per_node:
            return min(self.link.allreduce_busbw, self.network.allreduce_busbw)
        return self.link.allreduce_busbw

    def gather_busbw_at(self, devices: int) -> float:
        """Bus bandwidth of an all-gather or reduce-scatter over ``devices`` (fsdp's collectives)."""
        ring = self.allreduce_busbw(devices)
        return ring if self.gather_busbw is None else min(ring, self.gather_busbw)

    def single_process(self, devices: int) -> bool:
        """Whether ``devices`` fit in one process (DataParallel cannot span nodes)."""
        return self.devices_per_node is None or devices <= self.devices_per_node


def gpu_platform(
    spec: GpuSpec,
    device_link: LinkSpec,
    *,
    network: LinkSpec | None = None,
    devices_per_node: int | None = None,
    overlap: float = DEFAULT_GPU_OVERLAP,
    pinned: bool = False,
    host: HostCosts = DEFAULT_HOST,
) -> Platform:
    """A platform of ``spec`` GPUs joined by ``device_link`` (and ``network`` across nodes).

    ``host``: the CPU side's costs (default: measured on the development machine); every kernel
    also pays :data:`multigpu.planning.host.GPU_LAUNCH_S`.
    """
    return Platform(
        name=f"{spec.name} / {device_link.name}" + (f" / {network.name}" if network else ""),
        memory_bytes=spec.memory_bytes,
        memory_bandwidth=spec.memory_bandwidth,
        link=device_link,
        host_bandwidth=link(spec.host_link).copy_bandwidth,
        pinned=pinned,
        host=host.on_gpu(),
        overlap=overlap,
        context_bytes=spec.context_bytes,
        devices_per_node=devices_per_node,
        network=network,
    )
