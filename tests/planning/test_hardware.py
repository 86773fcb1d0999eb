from __future__ import annotations

import pytest

from multigpu.errors import ConfigError
from multigpu.planning import hardware


def test_every_preset_names_its_source() -> None:
    for spec in [*hardware.GPUS.values(), *hardware.LINKS.values()]:
        assert spec.source.strip(), spec.name


def test_vendor_figures_match_the_published_table() -> None:
    assert hardware.gpu("h200-141gb").memory_bytes == pytest.approx(141e9)
    assert hardware.gpu("a100-40gb").memory_bandwidth == pytest.approx(1.555e12)
    assert hardware.link("nvlink-a100").allreduce_busbw == pytest.approx(234.89e9)
    # PCIe all-reduce carries the 8x RTX 5090 efficiency (28 of 63 GB/s) to Gen3.
    assert hardware.link("pcie3").allreduce_busbw == pytest.approx(15.7e9 * 28 / 63)
    assert hardware.link("pcie3-nop2p").allreduce_busbw == pytest.approx(3.9e9)


@pytest.mark.parametrize(
    ("typed", "preset"),
    [
        ("v100", "v100-16gb"),
        ("P100", "p100-16gb"),
        ("T4", "t4"),
        ("1080 Ti", "gtx-1080-ti"),
        ("2080ti", "rtx-2080-ti"),
        ("RTX 3090", "rtx-3090"),
        ("4090", "rtx-4090"),
        ("A10", "a10"),
        ("l4", "l4"),
        ("A6000", "rtx-a6000"),
        ("L40S", "l40s"),
        ("H100", "h100-80gb"),
        ("h200", "h200-141gb"),
    ],
)
def test_gpu_names_people_type_find_the_preset(typed: str, preset: str) -> None:
    assert hardware.gpu(typed).name == preset


def test_only_ampere_and_later_datacenter_gpus_carry_tf32() -> None:
    assert hardware.gpu("a100-80gb").tf32_flops == pytest.approx(156e12)
    assert hardware.gpu("h100").tf32_flops == pytest.approx(494.7e12)
    assert hardware.gpu("v100").tf32_flops is None and hardware.gpu("t4").tf32_flops is None


def test_custom_gpu_from_three_figures_or_a_changed_preset() -> None:
    spec = hardware.custom_gpu(fp32_tflops=20, memory_gb=12, memory_bandwidth_gbs=500)
    assert (spec.fp32_flops, spec.memory_bytes, spec.memory_bandwidth) == (20e12, 12 * 2**30, 500e9)
    bigger = hardware.custom_gpu(memory_gb=96, base=hardware.gpu("h100"))
    assert bigger.memory_bytes == 96 * 2**30 and bigger.fp32_flops == hardware.gpu("h100").fp32_flops
    assert bigger.tf32_flops == hardware.gpu("h100").tf32_flops  # TFLOPS unchanged: TF32 kept
    with pytest.raises(ConfigError, match=r"missing --gpu-mem-bw \(or pass --gpu NAME\)"):
        hardware.custom_gpu(fp32_tflops=20, memory_gb=12)
    with pytest.raises(ConfigError, match=r"fp32_flops=-1000000000000.0 must be > 0"):
        hardware.custom_gpu(fp32_tflops=-1, memory_gb=12, memory_bandwidth_gbs=500)


def test_faster_links_have_more_bandwidth() -> None:
    order = ["pcie3-nop2p", "pcie3", "pcie4", "pcie5", "nvlink-a100", "nvlink-h100"]
    busbw = [hardware.link(name).allreduce_busbw for name in order]
    assert busbw == sorted(busbw)


def test_unknown_names_list_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown GPU 'z80'; choose one of .*v100-32gb.*--gpu-tflops"):
        hardware.gpu("z80")
    with pytest.raises(ConfigError, match=r"unknown link 'carrier-pigeon'.*multigpu bandwidth"):
        hardware.link("carrier-pigeon")


def test_measured_link_rejects_zero_bandwidth() -> None:
    with pytest.raises(ConfigError, match=r"bandwidths must be > 0 .*busbw=0"):
        hardware.measured_link(0.0)
