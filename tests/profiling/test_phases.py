"""Phase marks: free while nobody listens; begin/end pairs (also on errors) while someone does."""

from __future__ import annotations

import pytest

from multigpu.profiling import phases


class _Recorder:
    """A listener that keeps what it hears (the thing under test is the mark, not the listener)."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, str | None, int]] = []

    def begin(self, name: str, device: str | None) -> object:
        return (name, device)

    def end(self, token: object, nbytes: int) -> None:
        name, device = token  # type: ignore[misc]
        self.heard.append((name, device, nbytes))


def test_idle_marks_share_one_empty_context() -> None:
    assert not phases.active()
    assert phases.phase("scatter") is phases.phase("forward", "cpu:1", nbytes=8)


def test_listener_hears_every_phase_once_even_when_the_block_raises() -> None:
    recorder = _Recorder()
    with phases.listening(recorder):
        assert phases.active()
        with phases.phase("scatter", nbytes=64):
            pass
        with pytest.raises(ValueError, match="boom"):
            with phases.phase("forward", "cpu:1"):
                raise ValueError("boom")
    assert not phases.active()
    assert recorder.heard == [("scatter", None, 64), ("forward", "cpu:1", 0)]


def test_listeners_nest_and_restore() -> None:
    outer, inner = _Recorder(), _Recorder()
    with phases.listening(outer):
        with phases.listening(inner):
            with phases.phase("gather"):
                pass
        with phases.phase("reduce"):
            pass
    assert [h[0] for h in inner.heard] == ["gather"] and [h[0] for h in outer.heard] == ["reduce"]


def test_fan_out_feeds_every_listener_in_nested_order() -> None:
    first, second = _Recorder(), _Recorder()
    with phases.listening(phases.fan_out(first, second)):
        with phases.phase("reduce", "cpu:0", nbytes=16):
            pass
    assert first.heard == second.heard == [("reduce", "cpu:0", 16)]
    assert phases.fan_out(first) is first
