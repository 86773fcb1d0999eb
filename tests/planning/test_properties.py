"""Properties of the cost and memory model over random workloads and platforms (hypothesis)."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from multigpu.planning import hardware
from multigpu.planning.advise import evaluate, recommend, to_json
from multigpu.planning.costs import device_memory, predict_step
from multigpu.planning.hardware import DEFAULT_HOST, Platform, gpu_platform
from multigpu.planning.memory import balanced_chunks
from multigpu.planning.workload import StepCounts, Workload
from tests.planning._platforms import two_core_cpu

workloads = st.builds(
    lambda params, c, act, out, ops, mods: Workload(
        name="w",
        params=params,
        compute_s_per_sample=c,
        activation_bytes_per_sample=act,
        output_bytes_per_sample=out,
        input_bytes_per_sample=1e4,
        counts=StepCounts(
            modules=mods,
            tensors=2 * mods,
            module_calls=mods,
            forward_ops=ops,
            backward_ops=2 * ops,
            forward_kernels=ops,
            backward_kernels=ops,
        ),
    ),
    st.integers(1_000, 2_000_000_000),
    st.floats(1e-7, 1.0),
    st.floats(0.0, 1e9),
    st.floats(0.0, 1e8),
    st.integers(0, 5_000),
    st.integers(0, 2_000),
)
platforms = st.one_of(
    st.sampled_from(
        [
            gpu_platform(hardware.gpu("a100-80gb"), hardware.link("nvlink-a100")),
            gpu_platform(hardware.gpu("t4"), hardware.link("pcie3"), pinned=True),
            gpu_platform(hardware.gpu("rtx-4090"), hardware.link("pcie3-nop2p")),
        ]
    ),
    st.builds(
        lambda contention: two_core_cpu(contention=contention, synchronous=True, host=DEFAULT_HOST),
        st.floats(1.0, 3.0),
    ),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(workloads, platforms, st.lists(st.integers(1, 512), min_size=1, max_size=8))
def test_every_step_is_the_sum_of_its_parts_and_grows_with_compute(
    w: Workload, plat: Platform, chunks: list[int]
) -> None:
    for strategy in ("single", "dp", "dp-balanced", "ddp", "fsdp"):
        step = predict_step(strategy, w, plat, chunks=chunks)
        assert math.isfinite(step.total_s) and step.total_s > 0
        assert step.total_s == sum(step.parts.values())
        assert step.global_batch == sum(chunks)
        slower = predict_step(strategy, w.with_compute(w.compute_s_per_sample * 2), plat, chunks=chunks)
        assert slower.total_s >= step.total_s


@settings(max_examples=60, deadline=None, derandomize=True)
@given(workloads, platforms, st.integers(2, 8), st.integers(8, 4096))
def test_balanced_chunks_never_raise_the_peak_above_an_even_split(
    w: Workload, plat: Platform, n: int, batch: int
) -> None:
    sizes = balanced_chunks(w, plat, n, batch)
    assert sum(sizes) == batch and min(sizes) >= 0
    even = [batch // n + (1 if i < batch % n else 0) for i in range(n)]
    one_sample = w.activation_bytes_per_sample + w.output_bytes_per_sample
    assert max(device_memory("dp", w, plat, sizes)) <= max(device_memory("dp", w, plat, even)) + one_sample + 1


@settings(max_examples=30, deadline=None, derandomize=True)
@given(workloads, platforms, st.integers(1, 256))
def test_the_recommendation_is_never_below_one_device_and_the_plan_is_json(
    w: Workload, plat: Platform, batch: int
) -> None:
    rows = evaluate(w, plat, [1, 2, 4], global_batch=4 * batch)
    rec = recommend(rows, plat.memory_bytes)
    single = next(r for r in rows if r.strategy == "single")
    if rec.strategy != "none":
        chosen = next(r for r in rows if (r.strategy, r.devices) == (rec.strategy, rec.devices))
        assert chosen.fits and (chosen.step.throughput >= single.step.throughput or not single.fits)
    json.dumps(to_json(rows, rec, {}), allow_nan=False)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(workloads, platforms, st.integers(1, 64))
def test_fsdp_is_recommended_only_where_ddp_does_not_fit_or_is_slower(w: Workload, plat: Platform, batch: int) -> None:
    rows = evaluate(w, plat, [1, 2, 8], batch)
    rec = recommend(rows, plat.memory_bytes)
    for r in rows:
        if r.strategy == "fsdp":  # groups of at most a tenth of the model: never more per device than ddp
            ddp = next(d for d in rows if d.strategy == "ddp" and d.devices == r.devices)
            assert max(r.memory) <= max(ddp.memory)
    if rec.strategy == "fsdp":
        fsdp = next(r for r in rows if (r.strategy, r.devices) == ("fsdp", rec.devices))
        ddp = next(r for r in rows if (r.strategy, r.devices) == ("ddp", rec.devices))
        assert not ddp.fits or ddp.step.throughput < 0.98 * fsdp.step.throughput
        assert ("DDP does not fit" in rec.sentence) == (not ddp.fits)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.integers(100_000_000, 20_000_000_000),
    st.floats(1e-4, 1e-1),
    st.floats(0.0, 1e8),
    st.sampled_from(["t4", "a100-80gb", "rtx-4090"]),
    st.integers(1, 16),
)
def test_where_only_fsdp_fits_it_is_recommended_and_the_reason_says_so(
    params: int, compute: float, activations: float, gpu: str, batch: int
) -> None:
    w = Workload(name="w", params=params, compute_s_per_sample=compute, activation_bytes_per_sample=activations)
    plat = gpu_platform(hardware.gpu(gpu), hardware.link("pcie4"))
    rows = evaluate(w, plat, [1, 2, 8], batch)
    rec = recommend(rows, plat.memory_bytes)
    fitting = {r.strategy for r in rows if r.fits}
    if fitting == {"fsdp"}:
        assert rec.strategy == "fsdp" and "DDP does not fit on" in rec.sentence
    if "ddp" in fitting and rec.strategy == "fsdp":  # only where it is clearly faster
        ddp = next(r for r in rows if (r.strategy, r.devices) == ("ddp", rec.devices))
        chosen = next(r for r in rows if (r.strategy, r.devices) == ("fsdp", rec.devices))
        assert ddp.step.throughput < 0.98 * chosen.step.throughput
