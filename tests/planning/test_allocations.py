"""What fsdp's processes map anew each step on a CPU: the census of a step's large allocations, and that it is real."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from multigpu.devices import get_device_type
from multigpu.devices.cpu import SHARDED_MMAP_THRESHOLD
from multigpu.planning.allocations import large_allocations
from multigpu.strategies import get_strategy
from tests.launching import run_command

KIB = 1 << 10
PAGE = 4096


def test_allocations_at_or_above_the_threshold_are_counted_once_each() -> None:
    def step() -> list[torch.Tensor]:
        kept = [torch.empty(n // 4) for n in (64 * KIB, 128 * KIB, 1024 * KIB)]
        torch.empty(512 * KIB // 4)  # freed at once: still one allocation of the step
        return kept

    seen = large_allocations(step, threshold=128 * KIB)
    assert (seen.count, seen.bytes) == (3, (128 + 1024 + 512) * KIB)


def test_a_convolutions_own_workspaces_are_counted_beyond_its_outputs() -> None:
    from tests.planning._reference_nets import small_cnn

    model, x = small_cnn(), torch.randn(16, 3, 32, 32)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    step()
    seen = large_allocations(step, threshold=SHARDED_MMAP_THRESHOLD)
    # the three blocks' outputs (conv, BatchNorm, ReLU) alone: 3 x (32x32x32 + 64x16x16 + 64x8x8) floats per sample
    outputs = 16 * 3 * (32 * 32 * 32 + 64 * 16 * 16 + 64 * 8 * 8) * 4
    assert seen.bytes > 2 * outputs  # and their gradients, and the convolutions' unfolded inputs
    assert seen.count == large_allocations(step, threshold=SHARDED_MMAP_THRESHOLD).count  # the same every step


def test_the_profilers_chatter_is_dropped_and_the_calls_own_stderr_kept(capfd: pytest.CaptureFixture[str]) -> None:
    large_allocations(lambda: os.write(2, b"the step's own warning\n"), threshold=1)
    err = capfd.readouterr().err
    assert "the step's own warning" in err
    assert "profiler_start" not in err and "profiler_stop" not in err


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc settings and minor page faults: Linux")
def test_fsdps_processes_fault_their_steps_large_buffers_anew_and_a_plain_process_does_not() -> None:
    script = str(Path(__file__).with_name("_page_faults.py"))
    sharded = get_strategy("fsdp").launch_env(get_device_type("cpu"), {})
    assert sharded, "the CPU's sharded processes set malloc's mmap threshold"
    runs = {}
    for name, env in (("plain", {"GLIBC_TUNABLES": ""}), ("fsdp", sharded)):
        done = run_command([sys.executable, script], env=env, timeout_s=120)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    pages = runs["fsdp"]["bytes"] / PAGE
    assert runs["fsdp"]["count"] == runs["plain"]["count"] > 10  # the census does not depend on malloc
    # every page of the counted buffers faults again each step (huge pages, where granted, fault fewer)
    assert runs["fsdp"]["faults_per_step"] > 0.5 * pages
    # glibc's own trimming makes a plain step fault from a few hundred to ~3.9 thousand pages of these ~11
    # thousand, by where the heap's top lies: fsdp's settings add at least half the buffers' pages on top
    assert runs["fsdp"]["faults_per_step"] - runs["plain"]["faults_per_step"] > 0.5 * pages
