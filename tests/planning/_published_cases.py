"""The published end-to-end cases (docs/planning.md, "Validation against published results"), predicted
from their setups: validation data for tests/planning/test_cases.py and test_fsdp.py, not part of the package.

Each case is built only from what its setup states (model, batch, GPU, link); the published
answers sit in separate fields and are only compared, never used to predict. Where a setup is
silent (the network of case 2's two machines, the batch of case 4) the assumption is named.

Example:
    >>> rows = hf_gpt2_dp_vs_ddp()
    >>> [r.faster_predicted == r.faster_published for r in rows]
    [True, True]
"""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.planning import hardware, workload
from multigpu.planning.costs import predict_step
from multigpu.planning.hardware import DEFAULT_GPU_OVERLAP, DEFAULT_HOST, HostCosts, Platform, gpu_platform
from multigpu.planning.memory import sharded_state_bytes
from multigpu.planning.workload import Workload


@dataclass(frozen=True)
class CaseRow:
    """One published number next to its prediction."""

    case: str
    quantity: str
    predicted: float
    published: float
    faster_predicted: str
    faster_published: str

    @property
    def ratio(self) -> float:
        """predicted / published."""
        return self.predicted / self.published


def _calibrated(w: Workload, plat: Platform, batch: int, measured_step_s: float) -> Workload:
    """The workload whose single-device step takes the measured time (per-sample compute solved for it).

    The step grows monotonically with the compute, so bisection finds it; host time that the
    device hides does not count twice.
    """
    low, high = 0.0, measured_step_s / batch
    for _ in range(60):
        mid = (low + high) / 2
        step = predict_step("single", w.with_compute(mid), plat, devices=1, per_device_batch=batch).total_s
        low, high = (mid, high) if step < measured_step_s else (low, mid)
    return w.with_compute(max(high, 1e-12))


def hf_gpt2_dp_vs_ddp(overlap: float = DEFAULT_GPU_OVERLAP) -> list[CaseRow]:
    """Case 1: 2x TITAN RTX, GPT-2 124M, batch 4 per device; DP and DDP with NVLink, DDP without."""
    gpu = hardware.gpu("titan-rtx")
    w = workload.from_preset("gpt2-124m", gpu)
    nvlink = gpu_platform(gpu, hardware.link("nvlink-titan-rtx"), overlap=overlap)
    no_p2p = gpu_platform(gpu, hardware.link("pcie3-nop2p"), overlap=overlap)
    dp = predict_step("dp", w, nvlink, devices=2, per_device_batch=4).total_s
    rows = []
    for label, plat, published_ddp in (("with NVLink", nvlink, 101.90), ("without NVLink", no_p2p, 131.44)):
        ddp = predict_step("ddp", w, plat, devices=2, per_device_batch=4).total_s
        rows.append(
            CaseRow(
                case="1 HF GPT-2, 2x TITAN RTX",
                quantity=f"DDP {label} / DP step time",
                predicted=ddp / dp,
                published=published_ddp / 110.59,
                faster_predicted="ddp" if ddp < dp else "dp",
                faster_published="ddp" if published_ddp < 110.59 else "dp",
            )
        )
    return rows


_DDP_BENCH = {
    "resnet50": (0.097, {2: 0.103, 4: 0.103, 8: 0.104, 16: 0.104}),
    "resnet101": (0.162, {2: 0.176, 4: 0.176, 8: 0.179, 16: 0.179}),
}


def pytorch_ddp_benchmark(overlap: float = DEFAULT_GPU_OVERLAP) -> list[CaseRow]:
    """Case 2: DGX-1 V100, batch 32 per GPU; the 1-GPU time is the measured input.

    16 GPUs span two DGX-1 machines; the source does not name their network: InfiniBand HDR assumed.
    """
    gpu = hardware.gpu("v100-32gb")
    plat = gpu_platform(
        gpu, hardware.link("nvlink-v100"), network=hardware.link("ib-hdr"), devices_per_node=8, overlap=overlap
    )
    rows = []
    for name, (single_s, published) in _DDP_BENCH.items():
        w = _calibrated(workload.from_preset(name, gpu), plat, 32, single_s)
        for n, pub in published.items():
            ddp = predict_step("ddp", w, plat, devices=n, per_device_batch=32)
            rows.append(
                CaseRow(
                    case=f"2 PyTorch DDP bench, {name}",
                    quantity=f"DDP {n} GPUs s/iter",
                    predicted=ddp.total_s,
                    published=pub,
                    faster_predicted="ddp" if ddp.throughput > 32 / single_s else "single",
                    faster_published="ddp" if n * 32 / pub > 32 / single_s else "single",
                )
            )
    return rows


def vertex_resnet50_t4(overlap: float = DEFAULT_GPU_OVERLAP) -> list[CaseRow]:
    """Case 3: ResNet-50, 4x T4 on PCIe Gen3, 32 images per GPU; DP vs DDP epoch time."""
    gpu = hardware.gpu("t4")
    plat = gpu_platform(gpu, hardware.link("pcie3"), overlap=overlap)
    w = workload.from_preset("resnet50", gpu)
    single = predict_step("single", w, plat, devices=1, per_device_batch=32).total_s
    dp = predict_step("dp", w, plat, devices=4, per_device_batch=32).total_s
    ddp = predict_step("ddp", w, plat, devices=4, per_device_batch=32).total_s
    faster = "ddp" if ddp < dp else "dp"
    row = lambda q, p, pub: CaseRow("3 Vertex AI ResNet-50, 4x T4", q, p, pub, faster, "ddp")  # noqa: E731
    return [
        row("DDP / DP epoch time", ddp / dp, 134 / 157),
        row("DP speedup over 1 GPU", 4 * single / dp, 489 / 157),
        row("DDP speedup over 1 GPU", 4 * single / ddp, 489 / 134),
    ]


def horovod_scaling(overlap: float = DEFAULT_GPU_OVERLAP) -> list[CaseRow]:
    """Case 4: 128 servers x 4 Pascal GPUs (P100, PCIe), 25 Gbit/s RoCE; scaling efficiency at 512.

    The batch per GPU is not in the setup: 64 assumed (tf_cnn_benchmarks' usual setting).
    """
    gpu = hardware.gpu("p100-16gb")
    plat = gpu_platform(
        gpu, hardware.link("pcie3"), network=hardware.link("roce-25g"), devices_per_node=4, overlap=overlap
    )
    rows = []
    for name, published in (("inception-v3", 0.90), ("resnet101", 0.90), ("vgg16", 0.68)):
        w = workload.from_preset(name, gpu)
        single = predict_step("single", w, plat, devices=1, per_device_batch=64).total_s
        ddp = predict_step("ddp", w, plat, devices=512, per_device_batch=64).total_s
        rows.append(
            CaseRow(f"4 Horovod, {name}", "scaling efficiency, 512 GPUs", single / ddp, published, "ddp", "ddp")
        )
    return rows


def dataparallel_regimes(host: HostCosts = DEFAULT_HOST) -> list[CaseRow]:
    """Public reports of ordinary nn.DataParallel training, reproduced qualitatively (issue 14).

    DataParallel is 2-4x slower than DDP for ResNet-50 on 8 A100-class GPUs, and slower than one
    GPU for ResNet-50 on 32x32 images at 256 per GPU on 2 and 4 GPUs. Setups: A100 80 GB on
    NVLink (nvlink-a100), pageable inputs, the resnet50 preset (compute from FLOPs), 32 images per
    GPU at 224x224 (the PyTorch DDP benchmark's batch), and 256 per GPU at 32x32. ``published``
    holds the bound the reports give: DP/DDP >= 2, DP/single throughput < 1. ``host``: the host
    costs of the machine driving the GPUs (default: measured on the development machine).
    """
    gpu = hardware.gpu("a100-80gb")
    plat = gpu_platform(gpu, hardware.link("nvlink-a100"), host=host)
    rows = []
    w = workload.from_preset("resnet50", gpu)
    dp = predict_step("dp", w, plat, devices=8, per_device_batch=32).total_s
    ddp = predict_step("ddp", w, plat, devices=8, per_device_batch=32).total_s
    rows.append(
        CaseRow(
            "ResNet-50, 8x A100, 32/GPU", "DP / DDP step time (>= 2)", dp / ddp, 2.0, "ddp" if ddp < dp else "dp", "ddp"
        )
    )
    small = workload.from_preset("resnet50", gpu, input_shape=(3, 32, 32))
    single = predict_step("single", small, plat, devices=1, per_device_batch=256).throughput
    for n in (2, 4):
        tput = predict_step("dp", small, plat, devices=n, per_device_batch=256).throughput
        rows.append(
            CaseRow(
                "ResNet-50 32x32, A100, 256/GPU",
                f"DP x{n} / single throughput (< 1)",
                tput / single,
                1.0,
                "dp" if tput > single else "single",
                "single",
            )
        )
    return rows


# ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
# Models", SC20, arXiv:1910.02054): model-state memory per device with P_os+g+p (stage 3: parameters,
# gradients and optimizer state partitioned, what FSDP implements), mixed-precision Adam (K = 12),
# in GB of 1e9 bytes. Figure 1: 7.5B parameters on 64 devices; Table 1: its bold cells for stage 3.
_ZERO_STAGE3_GB = {
    (7_500_000_000, 64): (1.9, "Figure 1"),
    (7_500_000_000, 4): (30.0, "Table 1"),
    (128_000_000_000, 64): (32.0, "Table 1"),
    (1_000_000_000_000, 1024): (15.6, "Table 1"),
}


def zero_stage3_memory() -> list[CaseRow]:
    """Case 5: the ZeRO paper's per-device memory of fully sharded model states, from the fsdp equation.

    Built from what the paper states (parameters, data-parallel degree, mixed-precision Adam) and
    predicted with the same term the fsdp rows of ``advise`` use (:func:`sharded_state_bytes`);
    the paper counts model states only (no activations, no gathered block), so only that term is
    compared. "faster" does not apply: both columns hold "fsdp".
    """
    rows = []
    for (params, devices), (published, where) in _ZERO_STAGE3_GB.items():
        w = Workload(name="zero", params=params, compute_s_per_sample=1.0, optimizer="adam", precision="amp")
        size = f"{params / 1e12:g}T" if params >= 1e12 else f"{params / 1e9:g}B"
        rows.append(
            CaseRow(
                f"5 ZeRO stage 3, {where}",
                f"{size} params, {devices} GPUs: GB/GPU",
                sharded_state_bytes(w, devices) / 1e9,
                published,
                "fsdp",
                "fsdp",
            )
        )
    return rows


def all_cases(overlap: float = DEFAULT_GPU_OVERLAP) -> list[CaseRow]:
    """Every published case, predicted."""
    return [
        *hf_gpt2_dp_vs_ddp(overlap),
        *pytorch_ddp_benchmark(overlap),
        *vertex_resnet50_t4(overlap),
        *horovod_scaling(overlap),
    ]
