"""Step profiler on the real DataParallel engine: accounting against known quantities."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest
import torch
from torch import nn

import multigpu
from multigpu.core.listeners import PHASES
from multigpu.errors import ConfigError
from multigpu.profiling.records import StepProfile
from multigpu.profiling.step import ProfileConfig, StepProfiler, profile_steps


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def _param_bytes(net: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in net.parameters())


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, micro: int = 1, batch: int = 12) -> None:
    for _ in range(steps):
        for _ in range(micro):
            x, y = torch.randn(batch, 8), torch.randint(0, 3, (batch,))
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("replicas", [2, 3])
def test_bytes_moved_match_parameters_inputs_and_outputs(replicas: int) -> None:
    net = _net()
    model = multigpu.DataParallel(net, devices=f"cpu:{replicas}")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with profile_steps(optimizer=opt, config=ProfileConfig(warmup=1)) as prof:
        _train(model, opt, steps=3, batch=12)
    profile = prof.profile()
    labels = [f"cpu:{i}" for i in range(replicas)]
    assert profile.devices == labels and len(profile.steps) == 2
    for step in profile.steps:
        by_key = {(p.phase, p.device): p for p in step.phases}
        assert by_key["replicate", "cpu:0"].nbytes == _param_bytes(net) * replicas  # broadcast: params x replicas
        assert by_key["reduce", "cpu:0"].nbytes == _param_bytes(net) * replicas  # every replica's gradients
        assert by_key["scatter", "cpu:0"].nbytes == 12 * 8 * 4  # the input batch, float32
        assert by_key["gather", "cpu:0"].nbytes == 12 * 3 * 4  # the outputs
        for label in labels:
            assert by_key["forward", label].calls == 1 and by_key["backward", label].calls == 1
        assert by_key["optimizer", "cpu:0"].calls == 1
        assert {p.phase for p in step.phases} == set(PHASES)
        # a replica's own phases fit inside the step
        assert sum(p.seconds for p in step.phases if p.device == "cpu:1") <= step.wall_s


def test_gradient_accumulation_counts_every_micro_batch_in_one_step() -> None:
    net = _net()
    model = multigpu.DataParallel(net, devices="cpu:2")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with profile_steps(optimizer=opt, config=ProfileConfig(warmup=0)) as prof:
        _train(model, opt, steps=2, micro=3)
    for step in prof.profile().steps:
        forward = [p for p in step.phases if p.phase == "forward"]
        assert [p.calls for p in forward] == [3, 3]
        reduce = next(p for p in step.phases if p.phase == "reduce")
        assert reduce.nbytes == 3 * 2 * _param_bytes(net)


def test_profiling_does_not_change_the_training() -> None:
    torch.manual_seed(1)
    profiled, plain = _net(), _net()
    plain.load_state_dict(profiled.state_dict())
    opt_a = torch.optim.SGD(profiled.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(plain.parameters(), lr=0.1)
    torch.manual_seed(2)
    with profile_steps(optimizer=opt_a):
        _train(multigpu.DataParallel(profiled, devices="cpu:2"), opt_a, steps=3)
    torch.manual_seed(2)
    _train(plain, opt_b, steps=3)  # the oracle: one device, same batches
    for p, q in zip(profiled.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q)


def test_hooks_are_gone_after_the_block() -> None:
    net = _net()
    model = multigpu.DataParallel(net, devices="cpu:2")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with profile_steps(config=ProfileConfig(warmup=0)) as prof:  # global optimizer hooks
        _train(model, opt, steps=2)
    assert not model._listeners.active  # the profiler detached itself from the model it found
    _train(model, opt, steps=2)
    assert len(prof.profile().steps) == 2


def test_given_a_model_only_its_phases_are_counted() -> None:
    net, other = _net(), _net()
    model, bystander = multigpu.DataParallel(net, devices="cpu:2"), multigpu.DataParallel(other, devices="cpu:3")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with profile_steps(model, optimizer=opt, config=ProfileConfig(warmup=0)) as prof:
        for _ in range(2):
            bystander(torch.randn(6, 8)).sum().backward()  # not profiled: another model
            _train(model, opt, steps=1)
    profile = prof.profile()
    assert profile.devices == ["cpu:0", "cpu:1"] and len(profile.steps) == 2
    assert all(p.calls == 1 for s in profile.steps for p in s.phases if p.phase == "forward")


def test_without_a_model_an_engine_built_inside_the_block_is_found() -> None:
    """``multigpu profile script.py`` cannot pass the model: engines are attached when first called."""
    with profile_steps(config=ProfileConfig(warmup=0)) as prof:
        net = _net()
        model = multigpu.DataParallel(net, devices="cpu:2")
        _train(model, torch.optim.SGD(net.parameters(), lr=0.1), steps=2)
    assert {p.phase for s in prof.profile().steps for p in s.phases} == set(PHASES)
    assert not model._listeners.active


def test_manual_steps_and_json_round_trip() -> None:
    model = multigpu.DataParallel(_net(), devices="cpu:2")
    profiler = StepProfiler(ProfileConfig(warmup=0, devices=["cpu:0", "cpu:1"]))
    with torch.no_grad(), model.add_listener(profiler):
        for _ in range(2):
            model(torch.randn(6, 8))
            profiler.step()
    profile = profiler.profile()
    again = StepProfile.from_json(profile.to_json())
    assert again == profile
    assert {p.phase for p in again.steps[0].phases} == {"scatter", "replicate", "forward", "gather"}


class _FixedPeaks:
    """A memory source with known numbers: the profiler must carry them into every step."""

    def __init__(self) -> None:
        self.resets = 0

    def reset_peaks(self) -> None:
        self.resets += 1

    def peak_bytes(self) -> Mapping[str, int]:
        return {"cpu:0": 3000 + self.resets, "cpu:1": 1000}


def test_memory_source_is_read_and_reset_every_step() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    source = _FixedPeaks()
    with profile_steps(optimizer=opt, config=ProfileConfig(warmup=0), memory=source) as prof:
        _train(multigpu.DataParallel(net, devices="cpu:2"), opt, steps=2)
    profile = prof.profile()
    assert [s.peak_bytes["cpu:0"] for s in profile.steps] == [3001, 3002]
    assert profile.peak_bytes() == {"cpu:0": 3002, "cpu:1": 1000}
    assert source.resets == 3


class _ThreadPeaks(_FixedPeaks):
    """A memory source that is also a phase listener: it learns which thread runs which replica."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: dict[str, set[int]] = {}

    def begin(self, name: str, device: str | None) -> object:
        if name in ("forward", "backward") and device is not None:
            self.threads.setdefault(device, set()).add(threading.get_ident())
        return None

    def end(self, token: object, nbytes: int) -> None:
        pass


def test_a_memory_source_that_listens_hears_the_replica_threads() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    source = _ThreadPeaks()
    with profile_steps(optimizer=opt, config=ProfileConfig(warmup=0), memory=source) as prof:
        _train(multigpu.DataParallel(net, devices="cpu:2"), opt, steps=2)
    assert set(source.threads) == {"cpu:0", "cpu:1"}
    assert source.threads["cpu:0"].isdisjoint(source.threads["cpu:1"])  # one thread per replica
    assert len(prof.profile().steps) == 2


@pytest.mark.parametrize("with_model", [False, True])
def test_track_memory_plugs_in_as_the_readme_shows(with_model: bool) -> None:
    """``profile_steps(model, ..., memory=track_memory())``: the tracker is entered for the block (once AttributeError)."""
    net = _net()
    model = multigpu.DataParallel(net, devices="cpu:2")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    memory = multigpu.track_memory(model, opt) if with_model else multigpu.track_memory()
    config = ProfileConfig(warmup=1, devices=["cpu:0", "cpu:1"])
    with profile_steps(model, optimizer=opt, config=config, memory=memory) as prof:
        _train(model, opt, steps=3, batch=64)
    profile = prof.profile()
    assert len(profile.steps) == 2 and profile.meta["memory"] is True
    for step in profile.steps:
        # each replica's forward and backward allocate at least its chunk's activations (32 x 32 floats)
        assert step.peak_bytes["cpu:0"] >= 32 * 32 * 4 and step.peak_bytes["cpu:1"] >= 32 * 32 * 4
    assert model._listeners._attached == ()  # the tracker left with the block, like the profiler


def test_a_memory_argument_that_is_no_source_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"memory=42 is not a memory source: pass track_memory\(\)"):
        with profile_steps(memory=42):  # type: ignore[arg-type]  # the wrong type is the test
            pass


def test_config_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"warmup=-1 must be >= 0"):
        ProfileConfig(warmup=-1)
    with pytest.raises(ConfigError, match=r"devices=\[\] names no device.*\['cpu:0', 'cpu:1'\]"):
        ProfileConfig(devices=[])


@pytest.mark.cuda
def test_cuda_phases_are_timed_with_events() -> None:
    count = torch.cuda.device_count()
    labels = [f"cuda:{i}" for i in range(count)]
    net = _net().cuda()
    # The loss on the replicas: on one GPU a plain call is nn.DataParallel's shortcut (the module called
    # as it is, no phases to time); with loss_fn every device count goes through the engine's step.
    model = multigpu.DataParallel(net, devices=labels, loss_fn=nn.CrossEntropyLoss())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with profile_steps(optimizer=opt, config=ProfileConfig(devices=labels)) as prof:
        for _ in range(3):
            x, y = torch.randn(16, 8, device="cuda"), torch.randint(0, 3, (16,), device="cuda")
            model(x, target=y).backward()
            opt.step()
            opt.zero_grad()
    profile = prof.profile()
    assert profile.timing == "cuda events" and len(profile.steps) == 2
    for step in profile.steps:
        assert all(p.seconds >= 0 for p in step.phases)
        assert step.seconds("forward", "cuda:0") > 0
        if count > 1:
            assert next(p for p in step.phases if p.phase == "replicate").nbytes == _param_bytes(net) * count


def test_the_auto_balancers_probe_step_is_not_counted() -> None:
    """The probe (an extra forward and backward on the second step) is heard by its own tracker only."""
    net = _net()
    model = multigpu.DataParallel(net, devices="cpu:2", chunk_sizes="auto")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with profile_steps(model, optimizer=opt, config=ProfileConfig(warmup=0)) as prof:
        _train(model, opt, steps=3)
    assert 12 in model.balance_plans  # the probe ran, on the second step
    for step in prof.profile().steps:
        assert [p.calls for p in step.phases if p.phase in ("forward", "backward")] == [1, 1, 1, 1]


def test_a_nested_engine_is_profiled_with_its_host() -> None:
    """A DataParallel inside the model (a teacher called in forward) reports to the same profiler."""

    class Student(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _net()
            self.teacher = multigpu.DataParallel(_net(), devices="cpu:3")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                hint = self.teacher(x)
            return self.body(x) + 0 * hint

    student = Student()
    model = multigpu.DataParallel(student, devices="cpu:2")
    opt = torch.optim.SGD(student.body.parameters(), lr=0.1)
    with profile_steps(model, optimizer=opt, config=ProfileConfig(warmup=0)) as prof:
        _train(model, opt, steps=1)
    labels = {p.device for p in prof.profile().steps[0].phases if p.phase == "forward"}
    assert labels == {"cpu:0", "cpu:1", "cpu:2"}  # the teacher's third replica too
