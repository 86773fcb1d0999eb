"""GPU and link presets for the planner, each figure with its public source.

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

Example:
    >>> gpu("v100-32gb").memory_bytes / 2**30
    32.0
    >>> round(link("pcie3").allreduce_busbw / 1e9, 1)
    7.0
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

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

_SHARED = "/work/shared/published_cases.md (vendor figures)"


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
    source: str = _SHARED

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
    source: str = _SHARED

    def __post_init__(self) -> None:
        if self.copy_bandwidth <= 0 or self.allreduce_busbw <= 0:
            raise ConfigError(
                f"link {self.name!r}: bandwidths must be > 0 (copy={self.copy_bandwidth}, "
                f"allreduce busbw={self.allreduce_busbw}); pass a measured busbw in bytes/s"
            )


def _gpu(
    name: str,
    mem_gb: float,
    bw_gbs: float,
    tflops: float,
    source: str,
    gib: bool = True,
    host: str = "pcie3",
    tf32: float | None = None,
) -> GpuSpec:
    return GpuSpec(
        name=name,
        host_link=host,
        memory_bytes=mem_gb * (GIB if gib else GB),
        memory_bandwidth=bw_gbs * GB,
        fp32_flops=tflops * 1e12,
        tf32_flops=tf32 * 1e12 if tf32 else None,
        source=source,
    )


_VENDOR = "NVIDIA product datasheet"
_TF32 = "TF32 dense (half the sparse figure)"
GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        _gpu("p100-16gb", 16, 732, 9.3, f"{_VENDOR}: Tesla P100 PCIe 16 GB, 732 GB/s, 9.3 TFLOPS fp32"),
        _gpu("gtx-1080-ti", 11, 484, 11.3, f"{_VENDOR}: GeForce GTX 1080 Ti 11 GB GDDR5X, 484 GB/s, 11.3 TFLOPS fp32"),
        _gpu("v100-16gb", 16, 900, 15.7, f"{_SHARED}; fp32 15.7 TFLOPS: {_VENDOR} (V100 SXM2)"),
        _gpu("v100-32gb", 32, 900, 15.7, f"{_SHARED}; fp32 15.7 TFLOPS: {_VENDOR} (V100 SXM2)"),
        _gpu("titan-rtx", 24, 672, 16.3, f"{_VENDOR}: TITAN RTX 24 GB GDDR6, 672 GB/s, 16.3 TFLOPS fp32"),
        _gpu("t4", 16, 320, 8.1, f"{_VENDOR}: T4 16 GB GDDR6, 320 GB/s, 8.1 TFLOPS fp32"),
        _gpu("rtx-2080-ti", 11, 616, 13.4, f"{_VENDOR}: GeForce RTX 2080 Ti 11 GB GDDR6, 616 GB/s, 13.4 TFLOPS fp32"),
        _gpu(
            "a100-40gb", 40, 1555, 19.5, f"{_SHARED}; fp32 19.5, {_TF32} 156 TFLOPS: {_VENDOR}", host="pcie4", tf32=156
        ),
        _gpu(
            "a100-80gb", 80, 2000, 19.5, f"{_SHARED}; fp32 19.5, {_TF32} 156 TFLOPS: {_VENDOR}", host="pcie4", tf32=156
        ),
        _gpu("a10", 24, 600, 31.2, f"{_VENDOR}: A10 24 GB GDDR6, 600 GB/s, 31.2 TFLOPS fp32", host="pcie4"),
        _gpu(
            "rtx-3090",
            24,
            936,
            35.6,
            f"{_VENDOR}: GeForce RTX 3090 24 GB GDDR6X, 936 GB/s, 35.6 TFLOPS fp32",
            host="pcie4",
        ),
        _gpu("rtx-a6000", 48, 768, 38.7, f"{_VENDOR}: RTX A6000 48 GB GDDR6, 768 GB/s, 38.7 TFLOPS fp32", host="pcie4"),
        _gpu("l4", 24, 300, 30.3, f"{_VENDOR}: L4 24 GB GDDR6, 300 GB/s, 30.3 TFLOPS fp32", host="pcie4"),
        _gpu(
            "rtx-4090",
            24,
            1008,
            82.6,
            f"{_VENDOR}: GeForce RTX 4090 24 GB GDDR6X, 1008 GB/s, 82.6 TFLOPS fp32",
            host="pcie4",
        ),
        _gpu("l40s", 48, 864, 91.6, f"{_VENDOR}: L40S 48 GB GDDR6, 864 GB/s, 91.6 TFLOPS fp32", host="pcie4"),
        _gpu(
            "h100-80gb",
            80,
            3350,
            67.0,
            f"{_SHARED}; fp32 67, {_TF32} 494.7 TFLOPS: {_VENDOR} (H100 SXM)",
            host="pcie5",
            tf32=494.7,
        ),
        _gpu(
            "h200-141gb",
            141,
            4800,
            67.0,
            f"{_SHARED}; fp32 67, {_TF32} 494.7 TFLOPS: {_VENDOR} (H200 SXM)",
            gib=False,
            host="pcie5",
            tf32=494.7,
        ),
    )
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


def _nvlink(name: str, one_way_gbs: float, measured_busbw: float | None, source: str) -> LinkSpec:
    busbw = measured_busbw if measured_busbw is not None else one_way_gbs * NVLINK_ALLREDUCE_EFFICIENCY
    return LinkSpec(
        name=name,
        copy_bandwidth=one_way_gbs * NVLINK_ALLREDUCE_EFFICIENCY * GB,
        allreduce_busbw=busbw * GB,
        source=source,
    )


def _pcie(name: str, one_way_gbs: float, source: str = _SHARED) -> LinkSpec:
    return LinkSpec(
        name=name,
        copy_bandwidth=one_way_gbs * PCIE_COPY_EFFICIENCY * GB,
        allreduce_busbw=one_way_gbs * PCIE_ALLREDUCE_EFFICIENCY * GB,
        source=f"{source}; all-reduce at the 8x RTX 5090 PCIe efficiency 28/63",
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
        _nvlink("nvlink-v100", 150, None, f"{_SHARED}; busbw at the A100 NVSwitch efficiency"),
        _nvlink("nvlink-a100", 300, 234.89, f"{_SHARED}; busbw measured, 8 GPUs (nccl-tests)"),
        _nvlink("nvlink-h100", 450, 368.0, f"{_SHARED}; busbw measured ring, 8 GPUs"),
        # TITAN RTX: one NVLink bridge, 2 links, 100 GB/s both ways = 50 GB/s one way.
        _nvlink("nvlink-titan-rtx", 50, None, f"{_VENDOR}: TITAN RTX NVLink bridge 100 GB/s (2 links)"),
        _network("ib-hdr", 200, f"{_SHARED}: InfiniBand HDR 200 Gb/s per port"),
        _network("ib-ndr", 400, f"{_SHARED}: InfiniBand NDR 400 Gb/s per port"),
        _network("roce-25g", 25, f"{_SHARED}: Horovod benchmark network, 25 Gbit/s RoCE"),
    )
}


def gpu(name: str) -> GpuSpec:
    """The preset GPU called ``name``.

    Raises:
        ConfigError: an unknown name; the message lists the presets.
    """
    try:
        return GPUS[_BY_KEY[_key(name)]]
    except KeyError:
        raise ConfigError(
            f"unknown GPU {name!r}; choose one of {', '.join(GPUS)}, or describe it with "
            "--gpu-tflops, --gpu-mem-gb and --gpu-mem-bw"
        ) from None


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
    try:
        return LINKS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown link {name!r}; choose one of {', '.join(LINKS)}, or pass a measured "
            "bandwidth (multigpu bandwidth) instead"
        ) from None


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
