"""Bandwidth probes: nccl-tests arithmetic, size parsing, and real probes at small sizes."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from multigpu.devices import parse_devices
from multigpu.errors import ConfigError
from multigpu.launcher.allreduce_probe import probe_all_reduce
from multigpu.profiling.bandwidth import (
    BandwidthPoint,
    KiB,
    MiB,
    bus_factor,
    message_sizes,
    parse_size,
    probe_copy,
    probe_dp_pattern,
)
from tests.launching import alive, descendants


@pytest.mark.parametrize(
    ("kind", "ranks", "factor"),
    [
        ("all-reduce", 2, 1.0),
        ("all-reduce", 4, 1.5),
        ("all-reduce", 8, 1.75),
        ("all-gather", 4, 0.75),
        ("reduce-scatter", 2, 0.5),
        ("broadcast", 8, 1.0),
        ("reduce", 8, 1.0),
        ("copy", 1, 1.0),
    ],
)
def test_bus_factor_is_nccl_tests_definition(kind: str, ranks: int, factor: float) -> None:
    assert bus_factor(kind, ranks) == pytest.approx(factor)


def test_algbw_and_busbw_from_bytes_and_time() -> None:
    point = BandwidthPoint(probe="all-reduce gloo x4", kind="all-reduce", nbytes=8 * 10**6, seconds=0.004, ranks=4)
    assert point.algbw == pytest.approx(2.0)  # 8 MB in 4 ms
    assert point.busbw == pytest.approx(2.0 * 2 * 3 / 4)


def test_sizes_parse_and_double() -> None:
    assert parse_size("256MiB") == 256 * MiB and parse_size("4k") == 4 * KiB and parse_size("4096") == 4096
    assert message_sizes()[0] == KiB and message_sizes()[-1] == 256 * MiB and len(message_sizes()) == 19
    assert message_sizes(KiB, 64 * KiB, 4) == [KiB, 4 * KiB, 16 * KiB, 64 * KiB]


def test_size_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"size '12 parsecs' does not parse.*'256MiB'"):
        parse_size("12 parsecs")
    with pytest.raises(ConfigError, match=r"max size 1024 bytes is below the min size 4096; raise --max-size"):
        message_sizes(4096, 1024)
    with pytest.raises(ConfigError, match=r"factor=1 must be >= 2"):
        message_sizes(KiB, MiB, 1)
    with pytest.raises(ConfigError, match=r"min size 3 bytes must be a positive multiple of 4"):
        message_sizes(3, MiB)


def test_copy_probe_moves_the_bytes_it_reports() -> None:
    point = probe_copy(torch.device("cpu"), torch.device("cpu"), 64 * KiB, repeats=2)
    assert point.probe == "copy cpu->cpu" and point.nbytes == 64 * KiB
    assert point.seconds > 0 and point.algbw == pytest.approx(64 * KiB / point.seconds / 1e9)


def test_dp_pattern_on_cpu_reduces_and_says_why_broadcast_is_skipped() -> None:
    points, notes = probe_dp_pattern(parse_devices("cpu:2"), 16 * KiB, repeats=2)
    assert [p.kind for p in points] == ["reduce"] and points[0].ranks == 2
    assert any("shared storage, no bytes move" in n for n in notes)


@pytest.mark.multiprocess
def test_all_reduce_over_two_gloo_processes() -> None:
    """Started through the launcher (torchrun in this process): it leaves no process and no signal handler behind."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    points = probe_all_reduce([4 * KiB, 64 * KiB], world_size=2, backend="gloo", timeout_s=90, repeats=2)
    assert [p.nbytes for p in points] == [4 * KiB, 64 * KiB]
    assert all(p.kind == "all-reduce" and p.ranks == 2 and p.seconds > 0 for p in points)
    assert all(p.busbw == pytest.approx(p.algbw) for p in points)  # 2(n-1)/n == 1 for n == 2
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert alive(descendants(os.getpid())) == []


def test_all_reduce_needs_two_processes() -> None:
    with pytest.raises(ConfigError, match=r"world_size=1: an all-reduce needs at least 2 processes"):
        probe_all_reduce([KiB], world_size=1)


@pytest.mark.cuda
def test_host_device_copies_on_cuda() -> None:
    point = probe_copy(torch.device("cpu"), torch.device("cuda", 0), MiB, repeats=2)
    assert point.probe == "copy cpu->cuda:0" and point.algbw > 0
