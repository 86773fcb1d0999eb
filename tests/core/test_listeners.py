"""Engine listeners: free while nobody is attached; every phase heard once per attached listener."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import multigpu
from multigpu.core.listeners import PHASES, Listeners


class _Recorder:
    """A phase listener that keeps what it hears (the thing under test is the engine's reporting)."""

    def __init__(self, log: list[str] | None = None, name: str = "") -> None:
        self.heard: list[tuple[str, str | None, int]] = []
        self.log, self.name = log, name

    def begin(self, name: str, device: str | None) -> object:
        if self.log is not None:
            self.log.append(f"begin {self.name}")
        return (name, device)

    def end(self, token: object, nbytes: int) -> None:
        if self.log is not None:
            self.log.append(f"end {self.name}")
        name, device = token  # type: ignore[misc]
        self.heard.append((name, device, nbytes))


class _Scopes:
    """A replica listener: which thread entered which replica's scope."""

    def __init__(self) -> None:
        self.threads: dict[str, set[int]] = {}
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def replica_scope(self, label: str, device: torch.device) -> Iterator[None]:
        with self.lock:
            self.threads.setdefault(label, set()).add(threading.get_ident())
        yield


def test_idle_marks_share_one_empty_context() -> None:
    listeners = Listeners()
    assert not listeners.active
    assert listeners.phase("scatter") is listeners.phase("forward", "cpu:1", nbytes=8)
    assert listeners.replica_scope("cpu:0", torch.device("cpu")) is listeners.phase("gather")


def test_a_listener_hears_every_phase_once_even_when_the_block_raises() -> None:
    listeners, recorder = Listeners(), _Recorder()
    with listeners.add(recorder):
        assert listeners.active
        with listeners.phase("scatter", nbytes=64):
            pass
        with pytest.raises(ValueError, match="boom"), listeners.phase("forward", "cpu:1"):
            raise ValueError("boom")
    assert not listeners.active
    with listeners.phase("gather"):  # detached: not heard
        pass
    assert recorder.heard == [("scatter", None, 64), ("forward", "cpu:1", 0)]


def test_listeners_begin_in_attach_order_and_end_in_reverse() -> None:
    log: list[str] = []
    listeners = Listeners()
    first, second = _Recorder(log, "first"), _Recorder(log, "second")
    listeners.add(first)
    listeners.add(second)
    listeners.add(first)  # attaching twice is one attachment
    with listeners.phase("reduce", "cpu:0", nbytes=16):
        pass
    assert log == ["begin first", "begin second", "end second", "end first"]
    assert first.heard == second.heard == [("reduce", "cpu:0", 16)]


def test_isolated_hides_the_attached_listeners_and_restores_them() -> None:
    listeners, outer, inner = Listeners(), _Recorder(), _Recorder()
    listeners.add(outer)
    with listeners.isolated(), listeners.add(inner):
        with listeners.phase("forward", "cpu:0"):
            pass
    with listeners.phase("backward", "cpu:0"):
        pass
    assert [h[0] for h in inner.heard] == ["forward"] and [h[0] for h in outer.heard] == ["backward"]


def test_an_object_that_listens_to_nothing_is_refused() -> None:
    with pytest.raises(TypeError, match=r"object is not a listener: give it begin\(name, device\)"):
        Listeners().add(object())  # type: ignore[arg-type]


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def test_a_model_reports_only_to_its_own_listeners() -> None:
    """No process-wide listener: what is attached to one model hears nothing of another."""
    watched, other = multigpu.DataParallel(_net(), devices="cpu:2"), multigpu.DataParallel(_net(), devices="cpu:2")
    recorder = _Recorder()
    handle = watched.add_listener(recorder)
    x = torch.randn(6, 8)
    other(x).sum().backward()
    assert recorder.heard == []
    watched(x).sum().backward()
    heard = {(name, device) for name, device, _ in recorder.heard}
    assert heard == {
        ("scatter", "cpu:0"),
        ("replicate", "cpu:0"),
        ("forward", "cpu:0"),
        ("forward", "cpu:1"),
        ("gather", "cpu:0"),
        ("backward", "cpu:0"),
        ("backward", "cpu:1"),
        ("reduce", "cpu:0"),
    }
    assert {name for name, _ in heard} == set(PHASES) - {"optimizer"}  # the optimizer is not the engine's
    handle.remove()
    count = len(recorder.heard)
    watched(x).sum().backward()
    assert len(recorder.heard) == count


class _InScope(_Scopes):
    """Also says, on each thread, which replica's scope it is in (a replica's forward reads it)."""

    here = threading.local()

    @contextlib.contextmanager
    def replica_scope(self, label: str, device: torch.device) -> Iterator[None]:
        with super().replica_scope(label, device):
            _InScope.here.label = label
            try:
                yield
            finally:
                _InScope.here.label = None


class _Where(nn.Module):
    """Records, for each forward, the replica scope it ran in and its thread."""

    def __init__(self, seen: list[tuple[str | None, int]]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((getattr(_InScope.here, "label", None), threading.get_ident()))
        return x


def test_replica_scopes_are_entered_on_each_replicas_own_thread() -> None:
    seen: list[tuple[str | None, int]] = []
    model = multigpu.DataParallel(nn.Sequential(_net(), _Where(seen)), devices="cpu:3")
    scopes = _InScope()
    with model.add_listener(scopes), torch.no_grad():  # one forward: each replica enters its scope once
        model(torch.randn(9, 8))
    assert set(scopes.threads) == {"cpu:0", "cpu:1", "cpu:2"}
    # each replica's forward ran inside its own scope, on the thread that entered it
    assert sorted(label for label, _ in seen) == ["cpu:0", "cpu:1", "cpu:2"]
    assert all(scopes.threads[label] == {ident} for label, ident in seen if label is not None)
    # CPU replicas each compute on a worker with their share of the threads, replica 0 too: the caller waits
    assert threading.get_ident() not in {ident for _, ident in seen}
    model.close()


def test_a_copy_of_a_model_starts_with_nobody_listening() -> None:
    import copy

    model, recorder = multigpu.DataParallel(_net(), devices="cpu:2"), _Recorder()
    model.add_listener(recorder)
    copy.deepcopy(model)(torch.randn(4, 8))
    assert recorder.heard == []
