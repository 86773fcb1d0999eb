from __future__ import annotations

import pytest

from multigpu.planning import hardware, workload
from multigpu.planning.costs import device_memory
from multigpu.planning.hardware import gpu_platform
from multigpu.planning.memory import balanced_chunks, bytes_per_param
from multigpu.planning.workload import Workload


def _w(**kw: object) -> Workload:
    base: dict[str, object] = dict(name="m", params=100_000_000, compute_s_per_sample=1e-3)
    base.update(kw)
    return Workload(**base)  # type: ignore[arg-type]


PLAT = gpu_platform(hardware.gpu("v100-32gb"), hardware.link("nvlink-v100"))


def test_bytes_per_parameter_match_the_published_rules() -> None:
    assert bytes_per_param(_w(optimizer="adam")) == 16  # fp32 weights + grads + Adam
    assert bytes_per_param(_w(optimizer="sgd-momentum")) == 12
    assert bytes_per_param(_w(optimizer="adam", precision="amp")) == 18  # mixed precision: 16-18


def test_dataparallel_primary_carries_optimizer_state_and_gathered_outputs() -> None:
    w = _w(activation_bytes_per_sample=50e6, output_bytes_per_sample=10e6)
    primary, other = device_memory("dp", w, PLAT, [16, 16])
    # primary: 16 B/param + 16 samples + gathered outputs (32 samples, with their gradients)
    assert primary == pytest.approx(100e6 * 16 + 16 * 60e6 + 32 * 10e6 * 2 + PLAT.context_bytes)
    # replica: its copies of weights and gradients + its 16 samples
    assert other == pytest.approx(100e6 * 8 + 16 * 60e6 + PLAT.context_bytes)
    assert primary > other


def test_ddp_holds_full_state_and_one_bucket_buffer_per_process() -> None:
    mem = device_memory("ddp", _w(activation_bytes_per_sample=1e6), PLAT, [8, 8, 8, 8])
    assert len(set(mem)) == 1
    assert mem[0] == pytest.approx(100e6 * (16 + 4) + 8e6 + PLAT.context_bytes)


def test_balanced_chunks_lower_the_peak() -> None:
    w = workload.from_preset("gpt2-124m", hardware.gpu("titan-rtx"))
    even = device_memory("dp", w, PLAT, [8, 8])
    sizes = balanced_chunks(w, PLAT, 2, 16)
    balanced = device_memory("dp", w, PLAT, sizes)
    assert sum(sizes) == 16 and sizes[0] < 8
    assert max(balanced) < max(even)


def test_balanced_chunks_without_activation_sizes_split_evenly() -> None:
    assert balanced_chunks(_w(), PLAT, 3, 10) == [4, 3, 3]
