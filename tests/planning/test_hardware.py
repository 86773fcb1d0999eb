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


def test_faster_links_have_more_bandwidth() -> None:
    order = ["pcie3-nop2p", "pcie3", "pcie4", "pcie5", "nvlink-a100", "nvlink-h100"]
    busbw = [hardware.link(name).allreduce_busbw for name in order]
    assert busbw == sorted(busbw)


def test_unknown_names_list_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown GPU 'z80'; choose one of .*v100-32gb"):
        hardware.gpu("z80")
    with pytest.raises(ConfigError, match=r"unknown link 'carrier-pigeon'.*multigpu bandwidth"):
        hardware.link("carrier-pigeon")


def test_measured_link_rejects_zero_bandwidth() -> None:
    with pytest.raises(ConfigError, match=r"bandwidths must be > 0 .*busbw=0"):
        hardware.measured_link(0.0)
