"""The memory tracker on CUDA: peaks from the caching allocator's statistics, reset where it says so.

What :mod:`multigpu.profiling.memory` promises for a device whose type has allocator statistics:
``track_memory`` resets the peak of every replica device when the block starts; ``results()`` gives
the primary's ``resident`` (``memory_allocated`` at the start), ``peak`` (``max_memory_allocated``,
i.e. ``torch.cuda.memory_stats()["allocated_bytes.all.peak"]``) and ``activations = peak - resident``,
source "CUDA allocator"; as the step profiler's memory source, ``reset_peaks()`` at every step's end
starts the next step's peak from what is live. It reports allocated bytes, not reserved ones.
"""

from __future__ import annotations

import pytest
import torch

import multigpu
from multigpu.profiling.memory import track_memory
from multigpu.profiling.step import ProfileConfig, profile_steps
from tests.models import mlp

pytestmark = pytest.mark.cuda
MiB = 2**20


def _scratch(mib: int, device: int = 0) -> None:
    """Allocate ``mib`` MiB on ``cuda:device`` and free it again: the peak must show it."""
    block = torch.empty(mib * MiB, dtype=torch.uint8, device=torch.device("cuda", device))
    del block


def _warm(model: torch.nn.Module, x: torch.Tensor) -> None:
    """One step outside the measurement: cuBLAS's workspace comes from the allocator on first use."""
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def test_a_known_allocation_in_the_block_raises_each_devices_peak(gpu_ids: list[int]) -> None:
    model = multigpu.DataParallel(mlp().cuda(), device_ids=gpu_ids)
    x = torch.randn(64, 8, device="cuda")
    _warm(model, x)
    starts = {i: torch.cuda.memory_allocated(i) for i in gpu_ids}
    with track_memory(model) as mem:
        model(x).sum().backward()
        for i in gpu_ids:
            _scratch(16 * (i + 1), i)  # a different size per device
    stats = {i: torch.cuda.memory_stats(i) for i in gpu_ids}
    got = {m.label: m for m in mem.results()}
    assert list(got) == [f"cuda:{i}" for i in gpu_ids]
    for i in gpu_ids:
        row = got[f"cuda:{i}"]
        assert row.source == "CUDA allocator"
        assert row.peak == stats[i]["allocated_bytes.all.peak"]
        assert row.peak >= starts[i] + 16 * (i + 1) * MiB
    primary = got["cuda:0"]
    assert primary.resident == starts[0]
    assert primary.activations == primary.peak - primary.resident and primary.gathered == 0


def test_a_peak_from_before_the_block_is_not_reported() -> None:
    model = multigpu.DataParallel(mlp().cuda(), device_ids=[0])
    _scratch(512)
    start = torch.cuda.memory_allocated(0)
    assert torch.cuda.max_memory_allocated(0) >= start + 512 * MiB  # the earlier peak is there to forget
    with track_memory(model) as mem:
        _scratch(32)
    peak = mem.results()[0].peak
    assert start + 32 * MiB <= peak < start + 512 * MiB


def test_the_step_profiler_gets_each_steps_own_peak() -> None:
    net = mlp().cuda()
    model = multigpu.DataParallel(net, device_ids=[0])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(64, 8, device="cuda")
    _warm(model, x)
    floor = torch.cuda.memory_allocated(0)
    sizes = [256, 16, 64]  # the big step first: a peak that carried over would hide the later ones
    config = ProfileConfig(warmup=0, devices=["cuda:0"])
    with track_memory(model) as mem, profile_steps(model, optimizer=opt, memory=mem, config=config) as prof:
        for mib in sizes:
            model(x).sum().backward()
            _scratch(mib)
            opt.step()
            opt.zero_grad()
    peaks = [step.peak_bytes["cuda:0"] for step in prof.profile().steps]
    assert len(peaks) == len(sizes)
    assert peaks[0] >= floor + sizes[0] * MiB
    for peak, mib in zip(peaks[1:], sizes[1:]):
        assert floor + mib * MiB <= peak < floor + sizes[0] * MiB
