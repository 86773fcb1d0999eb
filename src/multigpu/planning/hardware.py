"""What a step runs on: GPU and link presets (each figure with its public source), the host's costs, the platform.

A :class:`GpuSpec` is what the time and memory models need from a device: memory, memory
bandwidth (the optimizer step is bandwidth-bound), fp32 peak (and, on Ampere and later, the TF32
tensor-core peak PyTorch's convolutions use by default), and the per-process CUDA context.
Names are forgiving: ``v100`` is the 16 GB V100, ``3090``, ``RTX 3090`` and ``rtx-3090`` are one GPU.
:func:`custom_gpu` describes any other GPU from three datasheet figures.
A :class:`LinkSpec` is what they need from the wire between devices: the bandwidth of a one-way
copy (DataParallel's broadcast, reduce, scatter and gather) and the all-reduce bus bandwidth
(DDP), defined as nccl-tests does: ``busbw = algbw * 2(n-1)/n``.
Where a link has no measured all-reduce figure of its own, the efficiency (measured busbw over
the one-way peak) of the nearest measured link of its kind carries over; the source says so.

:class:`HostCosts` are the seconds per item of the host driving the devices (Python, the
dispatcher, kernel launches), measured by :mod:`multigpu.planning.calibrate`. A :class:`Platform`
joins them: the devices, the link, the host and how replicas share; :func:`gpu_platform` builds
one from presets, :func:`multigpu.planning.cpu_plan.calibrate_cpu` measures this CPU.

Example:
    >>> gpu("v100-32gb").memory_bytes / 2**30
    32.0
    >>> round(link("pcie3").allreduce_busbw / 1e9, 1)
    7.0
    >>> gpu_platform(gpu("v100-32gb"), link("nvlink-v100")).compute_slowdown(8)
    1.0
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from multigpu.core.lookup import lookup
from multigpu.errors import ConfigError

GB = 1e9
GIB = 2**30

# Efficiencies that carry measured figures over to links without their own measurement.
# NVLink: A100 8-GPU NVSwitch all-reduce busbw 234.89 GB/s over 300 GB/s one way (nccl-tests).
NVLINK_ALLREDUCE_EFFICIENCY = 234.89 / 300.0
# PCIe: 8x RTX 5090 all-reduce busbw ~28 GB/s over Gen5's 63 GB/s per direction.
PCIE_ALLREDUCE_EFFICIENCY = 28.0 / 63.0
# PCIe one-way copies: H200 on Gen5 measured 55.4 GB/s host-device over 63 GB/s.
PCIE_COPY_EFFICIENCY = 55.4 / 63.0
# Networks carry no measured figure in our sources: we take the line rate at the PCIe copy
# efficiency (protocol overhead of the same order); an assumption, named in docs/planning.md.
NETWORK_EFFICIENCY = PCIE_COPY_EFFICIENCY

_GIVEN = "the caller's figures"


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator type."""

    name: str
    memory_bytes: float  # device memory
    memory_bandwidth: float  # bytes/s of HBM/GDDR (bounds the optimizer step)
    fp32_flops: float  # dense fp32 peak, FLOP/s (compute from FLOPs uses it)
    tf32_flops: float | None = None  # dense TF32 tensor-core peak where it beats fp32 in practice (A100, H100)
    context_bytes: float = 1.3e9  # CUDA context and allocator slack per process (V100 measurement)
    host_link: str = "pcie3"  # the PCIe generation inputs cross from host memory
    source: str = _GIVEN

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "memory_bandwidth", "fp32_flops"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"GpuSpec {self.name!r}: {field}={getattr(self, field)} must be > 0")


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """The connection between devices (or between nodes)."""

    name: str
    copy_bandwidth: float  # bytes/s of a one-way copy between two devices
    allreduce_busbw: float  # bytes/s, nccl-tests bus bandwidth of a large all-reduce
    source: str = _GIVEN

    def __post_init__(self) -> None:
        if self.copy_bandwidth <= 0 or self.allreduce_busbw <= 0:
            raise ConfigError(
                f"link {self.name!r}: bandwidths must be > 0 (copy={self.copy_bandwidth}, "
                f"allreduce busbw={self.allreduce_busbw}); pass a measured busbw in bytes/s"
            )


_VENDOR = "NVIDIA product datasheet"
# name, memory (bytes), memory bandwidth (GB/s), dense fp32 TFLOPS, dense TF32 tensor-core TFLOPS (half
# the sparse figure; only where it beats fp32 in practice: A100, H100, H200), the PCIe generation
# inputs cross, and the product as its datasheet names it.
_GPU_ROWS = (
    ("p100-16gb", 16 * GIB, 732, 9.3, None, "pcie3", "Tesla P100 PCIe 16 GB"),
    ("gtx-1080-ti", 11 * GIB, 484, 11.3, None, "pcie3", "GeForce GTX 1080 Ti 11 GB GDDR5X"),
    ("v100-16gb", 16 * GIB, 900, 15.7, None, "pcie3", "V100 SXM2 16 GB"),
    ("v100-32gb", 32 * GIB, 900, 15.7, None, "pcie3", "V100 SXM2 32 GB"),
    ("titan-rtx", 24 * GIB, 672, 16.3, None, "pcie3", "TITAN RTX 24 GB GDDR6"),
    ("t4", 16 * GIB, 320, 8.1, None, "pcie3", "T4 16 GB GDDR6"),
    ("rtx-2080-ti", 11 * GIB, 616, 13.4, None, "pcie3", "GeForce RTX 2080 Ti 11 GB GDDR6"),
    ("a100-40gb", 40 * GIB, 1555, 19.5, 156, "pcie4", "A100 40 GB"),
    ("a100-80gb", 80 * GIB, 2000, 19.5, 156, "pcie4", "A100 80 GB"),
    ("a10", 24 * GIB, 600, 31.2, None, "pcie4", "A10 24 GB GDDR6"),
    ("rtx-3090", 24 * GIB, 936, 35.6, None, "pcie4", "GeForce RTX 3090 24 GB GDDR6X"),
    ("rtx-a6000", 48 * GIB, 768, 38.7, None, "pcie4", "RTX A6000 48 GB GDDR6"),
    ("l4", 24 * GIB, 300, 30.3, None, "pcie4", "L4 24 GB GDDR6"),
    ("rtx-4090", 24 * GIB, 1008, 82.6, None, "pcie4", "GeForce RTX 4090 24 GB GDDR6X"),
    ("l40s", 48 * GIB, 864, 91.6, None, "pcie4", "L40S 48 GB GDDR6"),
    ("h100-80gb", 80 * GIB, 3350, 67.0, 494.7, "pcie5", "H100 SXM 80 GB"),
    ("h200-141gb", 141 * GB, 4800, 67.0, 494.7, "pcie5", "H200 SXM 141 GB"),
)
GPUS: dict[str, GpuSpec] = {
    name: GpuSpec(
        name=name,
        memory_bytes=memory,
        memory_bandwidth=bandwidth * GB,
        fp32_flops=fp32 * 1e12,
        tf32_flops=tf32 * 1e12 if tf32 else None,
        host_link=host,
        source=f"{_VENDOR}: {product}, {bandwidth} GB/s, {fp32} TFLOPS fp32" + (f", TF32 {tf32}" if tf32 else ""),
    )
    for name, memory, bandwidth, fp32, tf32, host, product in _GPU_ROWS
}
# Short names people type; anything else matches a preset after dropping case, spaces, '-' and '_'.
_ALIASES = {
    "v100": "v100-16gb",
    "p100": "p100-16gb",
    "1080ti": "gtx-1080-ti",
    "2080ti": "rtx-2080-ti",
    "3090": "rtx-3090",
    "4090": "rtx-4090",
    "a6000": "rtx-a6000",
    "h100": "h100-80gb",
    "h200": "h200-141gb",
}


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


_BY_KEY = {**{_key(n): n for n in GPUS}, **{_key(a): n for a, n in _ALIASES.items()}}
_BY_KEY.update({_key(n.removeprefix(p)): n for n in GPUS for p in ("gtx-", "rtx-") if n.startswith(p)})


def _nvlink(name: str, product: str, one_way_gbs: float, measured_busbw: float | None = None) -> LinkSpec:
    busbw = measured_busbw if measured_busbw is not None else one_way_gbs * NVLINK_ALLREDUCE_EFFICIENCY
    how = f"busbw {measured_busbw} GB/s measured, 8 GPUs" if measured_busbw else "busbw at the A100 NVSwitch efficiency"
    return LinkSpec(
        name=name,
        copy_bandwidth=one_way_gbs * NVLINK_ALLREDUCE_EFFICIENCY * GB,
        allreduce_busbw=busbw * GB,
        source=f"{_VENDOR}: {product} NVLink {one_way_gbs} GB/s one way; {how} (nccl-tests)",
    )


def _pcie(name: str, one_way_gbs: float) -> LinkSpec:
    return LinkSpec(
        name=name,
        copy_bandwidth=one_way_gbs * PCIE_COPY_EFFICIENCY * GB,
        allreduce_busbw=one_way_gbs * PCIE_ALLREDUCE_EFFICIENCY * GB,
        source=f"PCI-SIG: PCIe x16 {one_way_gbs} GB/s per direction; all-reduce at the 8x RTX 5090 PCIe efficiency 28/63",
    )


def _network(name: str, gbit: float, source: str) -> LinkSpec:
    rate = gbit / 8 * NETWORK_EFFICIENCY * GB
    return LinkSpec(name=name, copy_bandwidth=rate, allreduce_busbw=rate, source=source)


LINKS: dict[str, LinkSpec] = {
    k.name: k
    for k in (
        _pcie("pcie3", 15.7),
        _pcie("pcie4", 31.5),
        _pcie("pcie5", 63.0),
        # P2P disabled (NCCL_P2P_DISABLE=1, or GPUs that cannot do P2P): NCCL stages through host
        # shared memory. Measured on PCIe Gen3 x16, 2 GPUs: all-reduce 3.9 GB/s, broadcast 10.31,
        # reduce 9.62 GB/s (NVIDIA/nccl issue 384).
        LinkSpec(
            name="pcie3-nop2p",
            copy_bandwidth=9.62 * GB,
            allreduce_busbw=3.9 * GB,
            source="NVIDIA/nccl issue 384: SHM transport, PCIe Gen3 x16, 2 GPUs",
        ),
        _nvlink("nvlink-v100", "V100", 150),
        _nvlink("nvlink-a100", "A100", 300, 234.89),  # NVSwitch
        _nvlink("nvlink-h100", "H100", 450, 368.0),  # ring; ~480 with NVLS
        # TITAN RTX: one NVLink bridge, 2 links, 100 GB/s both ways = 50 GB/s one way.
        _nvlink("nvlink-titan-rtx", "TITAN RTX bridge", 50),
        _network("ib-hdr", 200, "InfiniBand HDR: 200 Gb/s per port"),
        _network("ib-ndr", 400, "InfiniBand NDR: 400 Gb/s per port"),
        _network("roce-25g", 25, "Horovod docs/benchmarks.rst: its network, 25 Gbit/s RoCE"),
    )
}


def gpu(name: str) -> GpuSpec:
    """The preset GPU called ``name``.

    Raises:
        ConfigError: an unknown name; the message lists the presets.
    """
    message = "unknown GPU {value!r}; choose one of {choices}, or describe it with --gpu-tflops, --gpu-mem-gb and --gpu-mem-bw"
    return GPUS[lookup(_BY_KEY, _key(name), message, choices=", ".join(GPUS), shown=name)]


def custom_gpu(
    *,
    fp32_tflops: float | None = None,
    memory_gb: float | None = None,
    memory_bandwidth_gbs: float | None = None,
    base: GpuSpec | None = None,
    host_link: str = "pcie4",
) -> GpuSpec:
    """A GPU from datasheet figures (fp32 TFLOPS, memory in GB, bandwidth in GB/s), or ``base`` with some changed.

    Raises:
        ConfigError: without ``base``, a missing figure; a figure <= 0.

    Example:
        >>> custom_gpu(fp32_tflops=20, memory_gb=24, memory_bandwidth_gbs=800).memory_bytes / 2**30
        24.0
    """
    given = {"--gpu-tflops": fp32_tflops, "--gpu-mem-gb": memory_gb, "--gpu-mem-bw": memory_bandwidth_gbs}
    missing = [flag for flag, value in given.items() if value is None]
    if base is None and missing:
        raise ConfigError(
            f"a GPU without a preset needs all three figures; missing {', '.join(missing)} (or pass --gpu NAME)"
        )
    figures: dict[str, object] = {"source": "the user's figures (--gpu-tflops, --gpu-mem-gb, --gpu-mem-bw)"}
    if fp32_tflops is not None:
        figures.update(fp32_flops=fp32_tflops * 1e12, tf32_flops=None)  # the user's figure is the one to use
    if memory_gb is not None:
        figures["memory_bytes"] = memory_gb * GIB
    if memory_bandwidth_gbs is not None:
        figures["memory_bandwidth"] = memory_bandwidth_gbs * GB
    if base is not None:
        return replace(base, name=f"{base.name} (custom)", **figures)  # type: ignore[arg-type]
    return GpuSpec(name="custom", host_link=host_link, **figures)  # type: ignore[arg-type]


def link(name: str) -> LinkSpec:
    """The preset link called ``name``.

    Raises:
        ConfigError: an unknown name; the message lists the presets.
    """
    message = (
        "unknown link {value!r}; choose one of {choices}, or pass a measured bandwidth (multigpu bandwidth) instead"
    )
    return lookup(LINKS, name.lower(), message, shown=name)


def measured_link(busbw: float, *, copy_bandwidth: float | None = None, name: str = "measured") -> LinkSpec:
    """A link from a measured all-reduce bus bandwidth (bytes/s), e.g. from ``multigpu bandwidth``.

    The copy bandwidth defaults to the bus bandwidth (a ring all-reduce moves data one way per
    step at that rate).
    """
    return LinkSpec(
        name=name,
        copy_bandwidth=copy_bandwidth if copy_bandwidth is not None else busbw,
        allreduce_busbw=busbw,
        source="measured by the user",
    )


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
        for name in TIME_FIELDS:  # `not >= 0`: NaN too (a cached file may hold one: JSON reads NaN)
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"HostCosts.{name}={getattr(self, name)} must be a finite number >= 0 seconds")
        if not (self.gil_contention > 0 and math.isfinite(self.gil_contention)):
            raise ConfigError(
                f"HostCosts.gil_contention={self.gil_contention} must be a finite number > 0 (1: threads serialise)"
            )

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
    # CPU (measured by two gloo processes, advise's calibration; 0 and None elsewhere): seconds of one
    # collective call beyond its bytes (ddp's per bucket; fsdp's per all-gather and reduce-scatter,
    # as fsdp's processes run them), and the bytes/s of copies into fresh memory under fsdp's malloc
    # settings (each buffer mapped anew: page faults), for fsdp's copies.
    collective_latency_s: float = 0.0
    gather_latency_s: float = 0.0
    sharded_copy_bandwidth: float | None = None
    # CPU, fsdp's processes (0 elsewhere): what one allocation at or above their mmap threshold costs
    # beyond reusing memory, per allocation (the mapping) and per byte: on 4 KiB pages (a page fault per
    # page) and, for a buffer's bytes past its first 2 MiB or so, on huge pages (None: at the 4 KiB rate).
    fresh_alloc_s: float = 0.0
    fresh_byte_s: float = 0.0
    fresh_huge_byte_s: float | None = None
    # CPU (measured; 0 elsewhere): what DDP adds to a step beyond its all-reduces (the reducer, its
    # hooks, two processes meeting at the all-reduce), planning.step_floors
    ddp_step_s: float = 0.0
    # CPU: how much faster one process with every core computes the whole batch than the
    # per-sample compute (one replica's, on its share of the cores) says; 1 elsewhere.
    single_speedup: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap <= 1.0:
            raise ConfigError(f"overlap={self.overlap} must be within [0, 1] (share of all-reduce hidden)")
        if self.contention < 1.0:
            raise ConfigError(f"contention={self.contention} must be >= 1 (a slowdown factor)")
        if self.memory_bandwidth <= 0:
            raise ConfigError(f"memory_bandwidth={self.memory_bandwidth} must be > 0 bytes/s")
        if self.gather_busbw is not None and self.gather_busbw <= 0:
            raise ConfigError(f"gather_busbw={self.gather_busbw} must be > 0 bytes/s (or None: the all-reduce's)")
        if self.ddp_step_s < 0:
            raise ConfigError(f"ddp_step_s={self.ddp_step_s} must be >= 0 seconds (0: nothing beyond the all-reduce)")
        if self.fresh_alloc_s < 0 or self.fresh_byte_s < 0 or (self.fresh_huge_byte_s or 0.0) < 0:
            raise ConfigError(
                f"fresh_alloc_s={self.fresh_alloc_s}, fresh_byte_s={self.fresh_byte_s}, fresh_huge_byte_s="
                f"{self.fresh_huge_byte_s} must be >= 0 seconds (0: free; fresh_huge_byte_s None: fresh_byte_s)"
            )
        if self.single_speedup <= 0:
            raise ConfigError(f"single_speedup={self.single_speedup} must be > 0 (1: no faster alone)")
        if self.devices_per_node is not None and self.network is None:
            raise ConfigError("devices_per_node is set but no network links the nodes; pass network=link('ib-hdr')")

    def input_bandwidth(self) -> float | None:
        """Bytes/s of the host -> device copy of a batch (pageable copies are slower)."""
        if self.host_bandwidth is None:
            return None
        return self.host_bandwidth * (1.0 if self.pinned else PAGEABLE_FRACTION)

    def compute_slowdown(self, replicas: int) -> float:
        """How much slower each replica computes while ``replicas`` run at once (1 on GPUs)."""
        if self.cores is None:
            return 1.0
        if replicas <= 1:
            return 1.0 / self.single_speedup
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
    also pays :data:`GPU_LAUNCH_S`.
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
