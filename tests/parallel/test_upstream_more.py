"""More of torch's own DataParallel tests (test/distributed/test_data_parallel.py), asked of
multigpu.DataParallel on CPU replicas: what test_upstream.py and test_semantics.py left out."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import multigpu
from multigpu.errors import ConfigError


class OneLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.fixture
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off, so that the test counts the cycles a call leaves (gc.collect)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("devices", ["cpu:2", "cpu:3"])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_step_leaves_no_reference_cycles(collector_paused: None, devices: str, batch: int) -> None:
    # torch's test_data_parallel_model_no_refcycles: what a forward leaves is freed by reference
    # counting alone, so the replicas and the graph go at once, not at the next collection
    model = multigpu.DataParallel(OneLinear(), devices=devices)
    try:
        model(torch.randn(batch, 1)).sum().backward()  # first step: imports, registrations, caches made once
        gc.collect()
        model(torch.randn(batch, 1))
        assert gc.collect() == 0
        model(torch.randn(batch, 1)).sum().backward()
        assert gc.collect() == 0
    finally:
        model.close()


@pytest.mark.parametrize("call", ["module", "functional"])
def test_a_module_off_the_primary_device_is_torchs_runtime_error(call: str) -> None:
    # torch's test_data_parallel_model_device: a RuntimeError that starts with torch's sentence
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    x = torch.randn(4, 2)
    with pytest.raises(RuntimeError, match=r"^module must have its parameters and buffers on device cpu .*'1.weight'"):
        if call == "module":
            multigpu.DataParallel(net, devices="cpu:2")(x)
        else:
            multigpu.data_parallel(net, x, devices="cpu:2")


class Noisy(nn.Module):
    """Random draws in training mode three ways: a Dropout module, RReLU, and attention's own dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.act = nn.RReLU()
        self.attn = nn.MultiheadAttention(16, 2, dropout=0.3, batch_first=True)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.drop(self.inp(x))).unsqueeze(1).repeat(1, 4, 1)
        return self.out(self.attn(h, h, h)[0].mean(1))


@pytest.mark.parametrize("devices, chunks", [("cpu:2", [6, 6]), ("cpu:3", [4, 4, 4])])
def test_cpu_replicas_draw_random_numbers_as_one_device_does_chunk_by_chunk(devices: str, chunks: list[int]) -> None:
    # CPU replicas share one generator: threads drawing from it at once took their numbers in the
    # order they reached it, so one seed gave different dropout masks from run to run
    net = Noisy()
    x = torch.randn(sum(chunks), 8)
    torch.manual_seed(5)
    want = torch.cat([net(part) for part in x.split(chunks)]).detach()  # one device, chunk after chunk
    model = multigpu.DataParallel(net, devices=devices)
    try:
        for _ in range(12):
            torch.manual_seed(5)
            assert torch.equal(model(x).detach(), want)
    finally:
        model.close()


class OwnDraws(nn.Module):
    """Draws in its own forward (no layer to find): ordered only under deterministic algorithms."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(nn.functional.dropout(x, 0.5, self.training)) + torch.rand(x.shape[0], 1)


def test_under_deterministic_algorithms_every_draw_of_cpu_replicas_is_in_order() -> None:
    net, x = OwnDraws(), torch.randn(12, 8)
    torch.manual_seed(2)
    want = torch.cat([net(part) for part in x.split([6, 6])]).detach()
    model = multigpu.DataParallel(net, devices="cpu:2")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(12):
            torch.manual_seed(2)
            assert torch.equal(model(x).detach(), want)
    finally:
        torch.use_deterministic_algorithms(before)
        model.close()


def test_a_module_that_is_not_a_module_is_named_at_construction() -> None:
    # it failed at the first call, with "'function' object has no attribute 'named_parameters'"
    with pytest.raises(ConfigError, match=r"module must be a torch.nn.Module, got function; wrap the callable"):
        multigpu.DataParallel(lambda t: t * 2, devices="cpu:2")  # type: ignore[arg-type]


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(0, 5), min_size=2, max_size=4).filter(lambda s: sum(s) > 0), seed=st.integers(0, 99))
def test_dropout_on_cpu_replicas_follows_one_device_for_any_chunk_sizes(sizes: list[int], seed: int) -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 2))
    x = torch.randn(sum(sizes), 4)
    torch.manual_seed(seed)
    want = torch.cat([net(part) for part in x.split(sizes) if len(part)]).detach()
    model = multigpu.DataParallel(net, devices=f"cpu:{len(sizes)}", chunk_sizes=sizes)
    try:
        torch.manual_seed(seed)
        assert torch.equal(model(x).detach(), want)
    finally:
        model.close()
