"""The fsdp rows: memory per process, time per step, groups as the Session makes them, the published check."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from multigpu.errors import ConfigError
from multigpu.planning import hardware, workload
from multigpu.planning.costs import collective_s, device_memory, exposed_fsdp_s, fsdp_collectives, predict_step
from multigpu.planning.counting import count_fsdp_groups
from multigpu.planning.hardware import DEFAULT_HOST, Platform, gpu_platform
from multigpu.planning.memory import sharded_state_bytes
from multigpu.planning.workload import FsdpLayout, Workload
from multigpu.strategies.fsdp import FSDPOptions, select_blocks
from tests.planning import _published_cases as cases
from tests.planning import _reference_nets as nets

MIB = 2**20


def _cpu(busbw: float = 1e9, gather_busbw: float | None = None, group_s: float = 0.0) -> Platform:
    return Platform(
        name="cpu",
        memory_bytes=None,
        memory_bandwidth=10e9,
        link=hardware.measured_link(busbw),
        peer_copies=False,
        overlap=0.0,
        synchronous=True,
        gather_busbw=gather_busbw,
        host=replace(DEFAULT_HOST, fsdp_group_s=group_s),
    )


def _w(groups: tuple[int, ...] = (100, 300, 600), **kw: object) -> Workload:
    base: dict[str, object] = dict(
        name="m",
        params=sum(groups),
        compute_s_per_sample=1e-3,
        activation_bytes_per_sample=10,
        output_bytes_per_sample=2,
        optimizer="adam",
        fsdp=FsdpLayout(groups=groups),
    )
    base.update(kw)
    return Workload(**base)  # type: ignore[arg-type]


# -- memory ------------------------------------------------------------------------------------------


def test_memory_of_a_small_model_by_hand() -> None:
    # 1000 parameters: root group 100, blocks 300 and 600; Adam; 4 processes of 5 samples (12 B each).
    plat = _cpu()
    shards = 1000 * (4 + 4 + 8) / 4  # fp32 parameters, gradients, Adam's two moments, over 4
    samples = 5 * (10 + 2)
    # fp32: root gathered + its gradients (2 x 4 x 100); around the largest block (600): itself, the next
    # one's all-gather output, its gradients (3 x 4) and a reduce-scatter input in flight (4).
    assert device_memory("fsdp", _w(), plat, [5] * 4) == [shards + 800 + 16 * 600 + samples] * 4
    # amp: gathered in bf16 (2 bytes), reduced in fp32: 2 x 2 x 100 + (3 x 2 + 4) x 600
    assert device_memory("fsdp", _w(precision="amp"), plat, [5] * 4)[0] == shards + 400 + 10 * 600 + samples
    bf16_reduce = _w(precision="amp", fsdp=FsdpLayout(groups=(100, 300, 600), reduce_fp32=False))
    assert device_memory("fsdp", bf16_reduce, plat, [5] * 4)[0] == shards + 400 + 8 * 600 + samples
    # reshard_after_forward=False: every block stays gathered (4 x 1000), root gradients (4 x 100),
    # the largest block's gradients and reduce-scatter input (8 x 600)
    kept = _w(fsdp=FsdpLayout(groups=(100, 300, 600), reshard_after_forward=False))
    assert device_memory("fsdp", kept, plat, [5] * 4)[0] == shards + 4000 + 400 + 4800 + samples


def test_fsdp_holds_less_than_ddp_when_state_dominates_and_each_process_pays_its_context() -> None:
    a100 = gpu_platform(hardware.gpu("a100-80gb"), hardware.link("nvlink-a100"))
    w = Workload(name="big", params=1_000_000_000, compute_s_per_sample=1e-3)  # groups not counted: 10 x 10%
    fsdp = device_memory("fsdp", w, a100, [1] * 8)[0]
    assert fsdp == pytest.approx(16e9 / 8 + 16 * 1e8 + a100.context_bytes)
    assert fsdp < 0.25 * device_memory("ddp", w, a100, [1] * 8)[0]


def test_sharded_state_is_zero_stage_3() -> None:
    # (2 + 2 + K) P / N with K = 12 (mixed precision Adam): FSDP2 holds 4 + 4 + 8 bytes, the same 16.
    for precision in ("fp32", "amp"):
        w = Workload(name="m", params=7_500_000_000, compute_s_per_sample=1.0, precision=precision)
        assert sharded_state_bytes(w, 64) == pytest.approx(16 * 7.5e9 / 64)
    sgd = Workload(name="m", params=1000, compute_s_per_sample=1.0, optimizer="sgd-momentum")
    assert sharded_state_bytes(sgd, 2) == 1000 * 12 / 2


def test_the_zero_paper_figures_are_reproduced_without_a_case_factor() -> None:
    rows = cases.zero_stage3_memory()
    assert [r.published for r in rows] == [1.9, 30.0, 32.0, 15.6]
    for row in rows:  # the published cells are rounded to their last digit
        assert abs(row.predicted - row.published) <= 0.05, row


# -- time ---------------------------------------------------------------------------------------------


def test_collectives_follow_nccl_tests_bus_bandwidth() -> None:
    # all-gather and reduce-scatter: busbw = algbw (n-1)/n, S the whole array
    assert collective_s("all-gather", 1e9, 4, 10e9) == pytest.approx(0.075)
    assert collective_s("reduce-scatter", 1e9, 2, 10e9) == pytest.approx(0.05)
    assert collective_s("all-gather", 1e9, 1, 10e9) == 0.0


def test_fsdp_moves_one_and_a_half_times_ddps_bytes_in_fp32_and_as_many_under_amp() -> None:
    # ZeRO: stage 3 costs 1.5x data parallelism's communication (all-gather twice, reduce-scatter once).
    plat = _cpu(busbw=1e9)
    w = _w(groups=(0, 500, 500))
    ddp = collective_s("all-reduce", w.grad_bytes, 4, 1e9)
    total, exposed = exposed_fsdp_s(w, plat, 4, 1.0, 2.0)
    assert total == pytest.approx(1.5 * ddp) and exposed == total  # CPU: nothing hides (overlap 0)
    amp_total, _ = exposed_fsdp_s(replace(w, precision="amp"), plat, 4, 1.0, 2.0)
    assert amp_total == pytest.approx(ddp)  # bf16 gathers (2 x 2 bytes) + fp32 reduce-scatter (4)


def test_no_reshard_after_forward_drops_the_backward_all_gathers_but_not_the_roots_first() -> None:
    plat = _cpu(busbw=1e9)
    w = _w()
    kept = replace(w, fsdp=replace(w.fsdp, reshard_after_forward=False))
    resharded, _ = exposed_fsdp_s(w, plat, 2, 1.0, 2.0)
    gathered_once, _ = exposed_fsdp_s(kept, plat, 2, 1.0, 2.0)
    assert resharded - gathered_once == pytest.approx(collective_s("all-gather", 900 * 4, 2, 1e9))


def test_overlap_hides_what_compute_covers_and_never_the_first_gather_or_last_reduce() -> None:
    gpu = gpu_platform(hardware.gpu("a100-80gb"), hardware.measured_link(1e9))
    w = _w(groups=(0, 500, 500))
    t_ag, t_rs = (collective_s(k, 2000, 4, 1e9) for k in ("all-gather", "reduce-scatter"))
    exposed = {eta: exposed_fsdp_s(w, replace(gpu, overlap=eta), 4, 1.0, 2.0)[1] for eta in (0.0, 0.5, 1.0)}
    total = exposed_fsdp_s(w, gpu, 4, 1.0, 2.0)[0]
    assert exposed[0.0] == pytest.approx(total) and exposed[1.0] < exposed[0.5] < exposed[0.0]
    # long compute: only the forward's and backward's first all-gathers and the last reduce-scatter remain
    assert exposed[1.0] == pytest.approx(2 * t_ag + t_rs)
    # no compute to hide behind: everything is exposed whatever the overlap
    assert exposed_fsdp_s(w, replace(gpu, overlap=1.0), 4, 0.0, 0.0)[1] == pytest.approx(total)


def test_fsdp_step_pays_hooks_per_group_and_steps_a_shard_of_the_optimizer() -> None:
    w = _w(optimizer_s=0.04)
    plain, hooked = _cpu(group_s=0.0), _cpu(group_s=1e-3)
    base = predict_step("fsdp", w, plain, devices=4, per_device_batch=8)
    slow = predict_step("fsdp", w, hooked, devices=4, per_device_batch=8)
    assert slow.parts["forward"] + slow.parts["backward"] == pytest.approx(
        base.parts["forward"] + base.parts["backward"] + 3 * 1e-3  # three groups, the root's included
    )
    assert base.parts["optimizer"] == pytest.approx(0.04 / 4)
    assert base.total_s == pytest.approx(sum(base.parts.values()))


def test_a_measured_gather_bandwidth_slows_fsdp_only() -> None:
    w = _w(groups=(0, 500_000, 500_000))
    fast, slow = _cpu(busbw=1e9), _cpu(busbw=1e9, gather_busbw=0.25e9)
    assert predict_step("ddp", w, slow, devices=2, per_device_batch=4).total_s == pytest.approx(
        predict_step("ddp", w, fast, devices=2, per_device_batch=4).total_s
    )
    ratio = exposed_fsdp_s(w, slow, 2, 1.0, 2.0)[0] / exposed_fsdp_s(w, fast, 2, 1.0, 2.0)[0]
    assert ratio == pytest.approx(4.0)


def test_fsdps_own_large_allocations_cost_a_mapping_each_and_their_bytes_and_slow_no_other_strategy() -> None:
    w = _w(large_allocations=40, large_allocation_bytes_per_sample=3 * MIB)
    plain, mapping = _cpu(), replace(_cpu(), fresh_alloc_s=50e-6, fresh_byte_s=0.25e-3 / MIB)
    step = predict_step("fsdp", w, mapping, devices=2, per_device_batch=16)
    assert step.parts["fresh memory"] == pytest.approx(40 * 50e-6 + 16 * 3 * 0.25e-3)
    assert step.total_s == pytest.approx(predict_step("fsdp", w, plain, devices=2, per_device_batch=16).total_s + 0.014)
    for strategy in ("single", "dp", "ddp"):  # their processes reuse freed memory: nothing is mapped anew
        assert predict_step(strategy, w, mapping, devices=2, per_device_batch=16).total_s == pytest.approx(
            predict_step(strategy, w, plain, devices=2, per_device_batch=16).total_s
        )


def test_an_allocations_bytes_past_its_first_2_mib_are_charged_at_the_huge_pages_rate() -> None:
    """A fresh mapping holds no huge page before its first 2 MiB boundary nor after its last: the planner charges
    each allocation's first 2 MiB (SMALL_PAGE_BYTES) at the 4 KiB pages' rate and the rest at the huge pages'.
    Under fsdp's malloc settings a fresh 4 KiB cost 1.4-1.6 us beyond a warm one in buffers under 2 MiB and
    0.5 us over a whole 8 MiB buffer on the development cores; one rate for both planned the small-batch
    CNN's fsdp step 20-30% short."""
    from multigpu.planning.costs import SMALL_PAGE_BYTES, fresh_memory_s

    plat = replace(_cpu(), fresh_alloc_s=0.0, fresh_byte_s=1e-9, fresh_huge_byte_s=0.1e-9)
    small = _w(large_allocations=10, large_allocation_bytes_per_sample=10 * MIB)  # 1 MiB each at one sample
    assert fresh_memory_s(small, plat, 1) == pytest.approx(10 * MIB * 1e-9)  # all on 4 KiB pages
    big = fresh_memory_s(small, plat, 8)  # 8 MiB each: 2 on small pages, 6 on huge ones
    assert big == pytest.approx(10 * (SMALL_PAGE_BYTES * 1e-9 + (8 * MIB - SMALL_PAGE_BYTES) * 0.1e-9))
    one_rate = replace(plat, fresh_huge_byte_s=None)  # not measured: every byte at the 4 KiB rate, as before
    assert fresh_memory_s(small, one_rate, 8) == pytest.approx(10 * 8 * MIB * 1e-9)
    with pytest.raises(ConfigError, match="fresh_huge_byte_s=-1"):
        replace(plat, fresh_huge_byte_s=-1.0)


def test_a_group_without_parameters_issues_no_collective() -> None:
    with_root, without = _w(groups=(0, 500_000, 500_000)), _w(groups=(1, 500_000, 499_999))
    assert fsdp_collectives(with_root) == {"all-gather": 4, "reduce-scatter": 2}
    assert fsdp_collectives(without) == {"all-gather": 5, "reduce-scatter": 3}  # the root's: gathered once
    plat = replace(_cpu(), gather_latency_s=1e-3)
    empty_root = exposed_fsdp_s(with_root, plat, 2, 1.0, 2.0)[0]
    assert empty_root == pytest.approx(exposed_fsdp_s(without, plat, 2, 1.0, 2.0)[0] - 2e-3, rel=1e-3)


# -- groups ------------------------------------------------------------------------------------------


def test_groups_are_counted_as_fully_shard_claims_them() -> None:
    inner = nn.Linear(4, 4)
    block = nn.Sequential(inner, nn.Linear(4, 2))
    model = nn.Sequential(nn.Linear(2, 4), block, nn.Linear(2, 1))
    # children before parents: inner claims its 20, block the rest of its own (10); the root keeps 12 + 3
    assert count_fsdp_groups(model, [inner, block]) == (15, 10, 20)  # in forward (registration) order
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight  # shared: select_blocks leaves it to the root
    assert count_fsdp_groups(tied, select_blocks(tied, FSDPOptions())) == (40,)


class _TiedGPT2(nets.GPT2):
    """GPT-2 with the LM head as a module tied to the token embedding, as Hugging Face builds it."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(768, 50257, bias=False)
        self.lm_head.weight = self.wte.weight


@pytest.mark.parametrize(
    ("preset", "build"),
    [("gpt2-124m", _TiedGPT2), ("resnet50", nets.resnet50), ("resnet101", nets.resnet101), ("vgg16", nets.vgg16)],
)
def test_preset_groups_are_what_the_sessions_rule_makes_of_the_module_tree(preset: str, build: type) -> None:
    with torch.device("meta"):
        model = build()
    groups = count_fsdp_groups(model, select_blocks(model, FSDPOptions()))
    assert workload.preset(preset).fsdp_groups == groups
    assert sum(groups) == workload.preset(preset).params


def test_layouts_are_validated_and_rescaled() -> None:
    with pytest.raises(ConfigError, match=r"fsdp groups hold 999 parameters, not params=1000"):
        _w(groups=(99, 300, 600), params=1000)
    with pytest.raises(ConfigError, match=r"FsdpLayout\(groups=\[5, -1\]\) must count parameters"):
        FsdpLayout(groups=(5, -1))
    scaled = FsdpLayout(groups=(100, 300, 600)).scaled(10_001)
    assert sum(scaled.groups) == 10_001 and scaled.groups[:2] == (1000, 3000)
    assert FsdpLayout().resolved(1003) == (0, *[101] * 3, *[100] * 7)  # the default rule's bound: 10%


class _ResidualBlock(nn.Module):
    """benchmarks/fsdp_memory.py's block: x + outer(relu(inner(x)))."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.relu(self.inner(x)))


def test_the_measured_cpu_peak_of_the_fsdp_memory_benchmark_is_predicted() -> None:
    # benchmarks/RESULTS.md, "fsdp vs ddp": 16 blocks of 2 Linear(1024, 1024), AdamW, global batch 16 on
    # 2 gloo processes; as multigpu launch starts fsdp on CPU (freed buffers go back at once, so the
    # resident peak is the peak of live bytes) each process added 292-293 MiB in every round.
    from multigpu.planning.counting import count_step

    with torch.device("meta"):
        model = nn.Sequential(*[_ResidualBlock() for _ in range(16)])
    counted = count_step(model, torch.empty(8, 1024, device="meta"), loss_fn=lambda out: out.square().mean())
    w = Workload(
        name="fsdp_memory",
        params=counted.params,
        compute_s_per_sample=1.0,
        optimizer="adamw",
        activation_bytes_per_sample=counted.saved_bytes / 8,
        output_bytes_per_sample=counted.output_bytes / 8,
        fsdp=FsdpLayout(groups=count_fsdp_groups(model, select_blocks(model, FSDPOptions()))),
    )
    predicted = device_memory("fsdp", w, _cpu(), [8, 8])[0] / MIB
    assert predicted == pytest.approx(293, rel=0.05)


def test_without_reshard_only_the_first_gather_and_the_last_reduce_are_exposed() -> None:
    # reshard_after_forward=False: nothing is gathered in backward; long compute hides every collective
    # but forward's first all-gather and the last reduce-scatter.
    gpu = replace(gpu_platform(hardware.gpu("a100-80gb"), hardware.measured_link(1e9)), overlap=1.0)
    w = _w(groups=(0, 500, 500), fsdp=FsdpLayout(groups=(0, 500, 500), reshard_after_forward=False))
    t_ag, t_rs = (collective_s(k, 2000, 4, 1e9) for k in ("all-gather", "reduce-scatter"))
    assert exposed_fsdp_s(w, gpu, 4, 1.0, 2.0)[1] == pytest.approx(t_ag + t_rs)


def test_a_group_with_nothing_to_gather_does_not_wait_for_reduce_scatters_queued_on_the_link() -> None:
    # Root 600, blocks 200 + 200, no regather, backward 3r (r: one block's reduce-scatter): block 2
    # computes to 0.6r, its reduce-scatter runs to 1.6r; block 1 computes to 1.2r, its reduce-scatter
    # queues to 2.6r; the root computes 1.8r from 1.2r (not from 1.6r, when the link frees), to 3.0r,
    # and its reduce-scatter (3r) ends at 6.0r: 3.0r past the end of backward.
    gpu = replace(gpu_platform(hardware.gpu("a100-80gb"), hardware.measured_link(1e9)), overlap=1.0)
    w = _w(groups=(600, 200, 200), fsdp=FsdpLayout(groups=(600, 200, 200), reshard_after_forward=False))
    r = collective_s("reduce-scatter", 200 * 4, 4, 1e9)
    forward_exposed = collective_s("all-gather", 600 * 4, 4, 1e9)  # the root's, before anything computes
    assert exposed_fsdp_s(w, gpu, 4, 1.0, 3 * r)[1] == pytest.approx(forward_exposed + 3.0 * r)


def test_the_probes_tiny_fsdp_step_leaves_the_callers_random_streams_alone() -> None:
    from multigpu.planning.fsdp_probe_step import tiny_fsdp_step

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    tiny_fsdp_step(3, None)()  # built from its own seed (every process of a group alike) and run once
    assert torch.equal(torch.random.get_rng_state(), before)  # calibrate runs in the user's process
