"""What a DataParallel holds outside itself (replica threads, the auto-balancer's optimizer hook)
ends with it: on close(), or when it is garbage-collected."""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks

import multigpu
from tests.models import mlp

pytestmark = pytest.mark.timeout(60, method="thread")  # a hang ends the run with a stack dump


class ThreadSpy(nn.Module):
    """Records the threads its forward runs on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.threads: set[threading.Thread] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.add(threading.current_thread())
        return self.lin(x)


def _workers(spy: ThreadSpy) -> list[threading.Thread]:
    return [t for t in spy.threads if t is not threading.main_thread()]


def _all_end(threads: list[threading.Thread]) -> bool:
    for thread in threads:
        thread.join(10)
    return not any(t.is_alive() for t in threads)


def test_close_ends_the_replica_threads_and_the_model_still_works() -> None:
    spy = ThreadSpy()
    model = multigpu.DataParallel(spy, devices="cpu:3")
    for _ in range(3):
        model(torch.randn(6, 8)).sum().backward()
    workers = _workers(spy)
    # the same three workers served every step (CPU replicas all run on workers; the caller waits)
    assert len(workers) == 3
    assert all(t.is_alive() for t in workers)
    model.close()
    assert _all_end(workers)
    spy.threads.clear()
    model(torch.randn(6, 8)).sum().backward()  # still usable: threads that end after the step
    assert _all_end(_workers(spy))


def test_garbage_collection_ends_the_replica_threads() -> None:
    spy = ThreadSpy()
    model = multigpu.DataParallel(spy, devices="cpu:2")
    model(torch.randn(4, 8)).sum().backward()
    workers = _workers(spy)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
    assert _all_end(workers)


def test_the_auto_balancers_optimizer_hook_ends_with_the_model() -> None:
    before = len(_global_optimizer_post_hooks)
    closed = multigpu.DataParallel(mlp(), devices="cpu:2", chunk_sizes="auto")
    collected = multigpu.DataParallel(mlp(), devices="cpu:2", chunk_sizes="auto")
    assert len(_global_optimizer_post_hooks) == before + 2
    closed.close()
    assert len(_global_optimizer_post_hooks) == before + 1
    del collected
    gc.collect()
    assert len(_global_optimizer_post_hooks) == before


def test_a_deep_copy_owns_its_threads_and_hook() -> None:
    before = len(_global_optimizer_post_hooks)
    model = multigpu.DataParallel(mlp(), devices="cpu:2", chunk_sizes="auto")
    twin = copy.deepcopy(model)
    assert len(_global_optimizer_post_hooks) == before + 2
    x = torch.randn(4, 8)
    torch.testing.assert_close(twin(x), model(x))
    twin.close()  # closing the copy leaves the original's hook and threads in place
    assert len(_global_optimizer_post_hooks) == before + 1
    model(x).sum().backward()
    model.close()
    assert len(_global_optimizer_post_hooks) == before
