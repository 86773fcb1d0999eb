"""Intra-op threads of CPU replicas: each replica thread computes with its share of the caller's
threads, and the caller's own count, and the count new threads start with, are what they were.

``torch.set_num_threads`` sets the calling thread's count (and the process's figure a new thread
starts from); these tests read both back the way a user would: ``torch.get_num_threads()`` on the
caller, and on a thread started after the step.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import multigpu
from tests.models import assert_same_grads, mlp

pytestmark = pytest.mark.timeout(60, method="thread")  # a hang ends the run with a stack dump


class ThreadCounter(nn.Module):
    """Records (thread, intra-op threads) in forward and in backward."""

    def __init__(self, fail_on: int | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.seen: list[tuple[str, threading.Thread, int]] = []
        self.fail_on = fail_on
        self._lock = threading.Lock()

    def _record(self, phase: str) -> None:
        with self._lock:
            self.seen.append((phase, threading.current_thread(), torch.get_num_threads()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._record("forward")
        if self.fail_on is not None and x.shape[0] == self.fail_on:
            raise ValueError("this replica fails")
        out = self.lin(x)
        if out.requires_grad:
            out.register_hook(lambda grad: self._record("backward"))
        return out


def _new_thread_count() -> int:
    """The intra-op count a thread started now computes with."""
    found: list[int] = []
    thread = threading.Thread(target=lambda: found.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return found[0]


@pytest.fixture
def caller_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test with the caller at ``request.param`` intra-op threads; put the old count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("caller_threads", "replicas", "share"), [(2, 2, 1), (4, 2, 2), (1, 2, 1), (2, 3, 1)], indirect=["caller_threads"]
)
def test_each_replica_computes_with_its_share_and_the_caller_keeps_its_count(
    caller_threads: int, replicas: int, share: int
) -> None:
    net = ThreadCounter()
    model = multigpu.DataParallel(net, devices=f"cpu:{replicas}")
    for _ in range(2):
        model(torch.randn(6, 8)).sum().backward()
    assert {count for _, _, count in net.seen} == {share}
    assert {phase for phase, _, _ in net.seen} == {"forward", "backward"}
    # every replica on a worker: the caller only waits
    assert threading.current_thread() not in {thread for _, thread, _ in net.seen}
    assert torch.get_num_threads() == caller_threads
    assert _new_thread_count() == caller_threads
    model.close()


@pytest.mark.parametrize("caller_threads", [2], indirect=True)
def test_counts_are_restored_when_a_replica_raises(caller_threads: int) -> None:
    net = ThreadCounter(fail_on=2)  # the second of two chunks of 5 (3 and 2) fails
    model = multigpu.DataParallel(net, devices="cpu:2")
    try:
        with pytest.raises(ValueError, match="in replica 1 on device cpu:1 during forward"):
            model(torch.randn(5, 8))
    finally:
        model.close()
    assert torch.get_num_threads() == caller_threads
    assert _new_thread_count() == caller_threads


class Outer(nn.Module):
    """A model whose forward runs another DataParallel (a teacher) and records its thread counts."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.inner = inner
        self.counts: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counts.append(torch.get_num_threads())
        return self.lin(x) + self.inner(x)


@pytest.mark.parametrize("caller_threads", [4], indirect=True)
def test_nested_data_parallel_divides_the_outer_replicas_share_and_restores_the_callers(
    caller_threads: int,
) -> None:
    torch.manual_seed(0)
    teacher = ThreadCounter()
    twin = Outer(ThreadCounter())
    twin.load_state_dict(Outer(teacher).state_dict())  # same weights
    outer_net = Outer(multigpu.DataParallel(teacher, devices="cpu:2"))
    outer_net.load_state_dict(twin.state_dict())
    model = multigpu.DataParallel(outer_net, devices="cpu:2")
    x = torch.randn(8, 8)
    for _ in range(2):
        model.zero_grad()
        model(x).sum().backward()
    assert set(outer_net.counts) == {2}  # 4 threads, 2 outer replicas
    assert {count for _, _, count in teacher.seen} == {1}  # 2 threads, 2 inner replicas
    assert torch.get_num_threads() == caller_threads
    assert _new_thread_count() == caller_threads
    twin(x).sum().backward()
    assert_same_grads(outer_net, twin)
    model.close()
    outer_net.inner.close()


@pytest.mark.parametrize("caller_threads", [2], indirect=True)
def test_gradients_equal_one_device_with_divided_threads(caller_threads: int) -> None:
    torch.manual_seed(0)
    net, oracle = mlp(width=64), mlp(width=64)
    oracle.load_state_dict(net.state_dict())
    model = multigpu.DataParallel(net, devices="cpu:2")
    x = torch.randn(64, 8)
    model(x).square().mean().backward()
    oracle(x).square().mean().backward()
    assert_same_grads(net, oracle)
    model.close()


def test_under_the_profiler_replica_zero_runs_on_the_caller_and_the_trace_records_it() -> None:
    net = ThreadCounter()
    model = multigpu.DataParallel(net, devices="cpu:2")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.randn(6, 8)).sum().backward()
    forward_threads = [thread for phase, thread, _ in net.seen if phase == "forward"]
    assert threading.current_thread() in forward_threads
    assert len(forward_threads) == 2
    ops = [e for e in prof.events() if e.name == "aten::addmm"]
    assert ops  # replica 0's linear layer, on the thread the profiler records
    model.close()


def test_while_cpu_replica_workers_live_idle_openmp_threads_sleep_instead_of_spinning() -> None:
    # libgomp spins its idle team threads 300,000 pauses (milliseconds of a core) unless the process
    # has more OpenMP threads than cores; the replica workers make it so, while they live.
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(cores)  # the caller's team fills the cores, as the default does
    model = multigpu.DataParallel(mlp(), devices="cpu:2")
    try:
        model(torch.randn(8, 8)).sum().backward()
        big = torch.ones(cores << 16)  # a chunk of 65,536 per thread: parallel
        spun = []
        for _ in range(3):
            big.add_(1)  # a parallel op on the caller: its team's threads go idle after it
            began = time.process_time()
            time.sleep(0.05)
            spun.append(time.process_time() - began)
        assert min(spun) < 1e-3, f"CPU seconds used while idle: {spun}"
    finally:
        model.close()
        torch.set_num_threads(before)


def test_each_replica_runs_on_the_same_worker_every_step() -> None:
    threads_by_chunk: dict[int, set[threading.Thread]] = {}

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            threads_by_chunk.setdefault(x.shape[0], set()).add(threading.current_thread())
            return self.lin(x)

    model = multigpu.DataParallel(Spy(), devices="cpu:2")
    try:
        for _ in range(6):
            model(torch.randn(5, 8)).sum().backward()  # chunks of 3 (replica 0) and 2 (replica 1)
    finally:
        model.close()
    assert [len(threads_by_chunk[n]) for n in (3, 2)] == [1, 1]
    assert threads_by_chunk[3] != threads_by_chunk[2]
