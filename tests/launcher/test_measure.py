"""Strategies measured in processes of their own: failures classified, the budget enforced, nothing left behind."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from multigpu.errors import ConfigError
from multigpu.launcher.measure import MeasureRun, MeasureSpec, _failure_kind, _reason, measure
from multigpu.planning.measured import Measurement


def test_out_of_memory_is_told_apart_from_other_failures() -> None:
    cuda = "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    assert _failure_kind(1, cuda) == "out of memory"
    assert _reason(1, cuda) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (exit 1)"
    assert _failure_kind(-signal.SIGKILL, "") == "out of memory"  # the kernel's OOM killer leaves no message
    assert "out-of-memory killer" in _reason(-signal.SIGKILL, "")
    assert _failure_kind(1, "ValueError: bad shape\n") == "failed"
    assert _reason(2, "usage: x\nno error line here\n") == "no error line here (exit 2)"


def test_bad_specs_and_budgets_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one of them"):
        MeasureSpec()
    with pytest.raises(ConfigError, match=r"--script 'nope\.py' does not exist"):
        MeasureSpec(script="nope.py")
    # inf crashed the worker; 10**400 raised OverflowError converting it to a float
    for budget in (0, -1, float("inf"), float("nan"), 10 * 86400, "60", True, 10**400, -(10**400)):
        with pytest.raises(
            ConfigError, match=r"budget_s \(advise --budget\)=.*seconds > 0 and at most 86400|not a number"
        ):
            measure(
                [MeasureRun(strategy="single", devices=1)], MeasureSpec(factory="m:f", input_shape=[4]), budget_s=budget
            )  # type: ignore[arg-type]


# The two runs below each last their whole budget (killed at its end), and the budget must outlast the
# worker's start: they run side by side (threads, one measure() each), so the suite waits out one budget,
# not two. Each test checks its own run. The worker imports torch before the script runs (over 6 s on a
# loaded 2-core machine; torchrun and a ddp worker took 14-24 s to reach the script at a load of 16): a run
# killed before its script started has nothing to check, and is run again with twice the budget. A fixed
# budget long enough for the worst load (30 s and 35 s) made every run wait it out: the file's 41 s.
_HANGS = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "open({marker!r}, 'w').write(str(child.pid))\n"
    "time.sleep(600)\n"
)
_STUBBORN = (
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: None)\n"
    "open({marker!r}, 'w').write(str(os.getpid()))\n"
    "time.sleep(600)\n"
)
_SINGLE_BUDGETS_S = (8, 16, 32)
_DDP_BUDGETS_S = (12, 24, 48)


@dataclass
class _Killed:
    """One run past its budget: its result, its budget and wall time, whether its script wrote its pid (it
    started), and the state of that process 10 s after measure() returned at most ("gone", "Z", or its state
    if it ran on)."""

    result: Measurement
    budget_s: float
    seconds: float
    started: bool
    state: str


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, _Killed]:
    folder = tmp_path_factory.mktemp("budget")

    def run(name: str, source: str, strategy: str, budgets_s: tuple[float, ...]) -> _Killed:
        for attempt, budget_s in enumerate(budgets_s):
            marker, script = folder / f"{name}-{attempt}.pid", folder / f"{name}-{attempt}.py"
            script.write_text(source.format(marker=str(marker)))
            started = time.monotonic()
            [result] = measure(
                [MeasureRun(strategy=strategy, devices=1)], MeasureSpec(script=str(script)), budget_s=budget_s
            )
            seconds = time.monotonic() - started
            if marker.exists():
                state = _gone_within(int(marker.read_text()), 10)
                return _Killed(result, budget_s, seconds, started=True, state=state)
        return _Killed(result, budget_s, seconds, started=False, state="never started")

    with ThreadPoolExecutor(max_workers=2) as pool:
        hangs = pool.submit(run, "hangs", _HANGS, "single", _SINGLE_BUDGETS_S)
        stubborn = pool.submit(run, "stubborn", _STUBBORN, "ddp", _DDP_BUDGETS_S)
        return {"hangs": hangs.result(), "stubborn": stubborn.result()}


def _gone_within(pid: int, seconds: float) -> str:
    """``pid``'s state once it is gone or a zombie, or ``seconds`` have passed: "gone", "Z", or its state."""
    deadline = time.monotonic() + seconds
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "gone"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)  # the module's runs, at their longest budgets (a heavily loaded machine)
def test_a_run_past_its_budget_is_killed_with_what_it_started(killed_runs: dict[str, _Killed]) -> None:
    run = killed_runs["hangs"]
    assert run.result.status == "timed out" and "raise --budget" in run.result.reason
    assert run.seconds < run.budget_s + 20  # the limit, then SIGTERM's grace at most
    assert run.started, f"the script never started within {run.budget_s} s: nothing to check"
    assert run.state in ("gone", "Z"), f"the run's child outlived the run (state {run.state})"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_ddp_worker_that_ignores_sigterm_is_ended_with_its_run(killed_runs: dict[str, _Killed]) -> None:
    """torch elastic starts workers in sessions of their own: killing the launcher's group misses them."""
    run = killed_runs["stubborn"]
    assert run.result.status == "timed out"
    assert run.started, "the worker never started within the budget: nothing was checked"
    assert run.state in ("gone", "Z"), f"the ddp worker outlived its run (state {run.state})"


def test_the_step_is_the_low_quantile_of_the_slowest_ranks_steps_not_their_median() -> None:
    from multigpu.launcher.measure import MeasureRun, _combine

    # a burst of other work slows the last four steps of both ranks; rank 1's first step is slower
    steps = [0.010, 0.011, 0.012, 0.013, 0.050, 0.060, 0.070, 0.080]
    ranks = [
        {"step_s": steps, "samples": [4] * 8, "peak_bytes": [1]},
        {"step_s": [0.020, *steps[1:]], "samples": [4] * 8, "peak_bytes": [1]},
    ]
    measured = _combine(MeasureRun(strategy="ddp", devices=2, global_batch=8), 1.0, ranks)
    # per step the slower rank: 0.020, 0.011, 0.012, 0.013, 0.050, ...: the 25th percentile of 8 is the second
    assert measured.step_s == 0.012 and measured.steps == 8  # the median would read the burst: 0.035


def test_a_factory_run_warms_up_for_half_a_second_within_ten_steps() -> None:
    from multigpu.launcher._measure_worker import MAX_WARMUP_STEPS, WARMUP_STEPS, _more_warmup

    assert _more_warmup(0.010) == MAX_WARMUP_STEPS - WARMUP_STEPS  # 50 steps of 10 ms: capped
    assert _more_warmup(0.100) == 5 - WARMUP_STEPS
    assert _more_warmup(1.0) == 0  # two steps already span it


def test_a_script_run_warms_up_as_long_as_a_factory_run_before_its_timed_steps() -> None:
    from multigpu.launcher._measure_worker import MAX_WARMUP_STEPS, MeasureDone, _ScriptProbe

    written: dict = {}
    probe = _ScriptProbe({"deadline": time.time() + 60, "max_steps": 3}, written.update)
    calls = 0
    with pytest.raises(MeasureDone):
        for _ in range(100):  # optimizer steps microseconds apart: warming to 0.5 s takes the most steps
            calls += 1
            probe.on_step(None, None, None)  # type: ignore[arg-type]
    # the first step (no start), MAX_WARMUP_STEPS warm ones, then 3 timed
    assert calls == 1 + MAX_WARMUP_STEPS + 3 and len(written["step_s"]) == len(written["samples"]) == 3


def test_a_script_with_two_optimizers_is_timed_per_training_step_not_per_optimizer_step() -> None:
    # a GAN steps its generator's and its discriminator's optimizers once each per training step: every optimizer
    # step was taken for a training step, so half the intervals read ~0 and the low quantile reported one of them
    import torch

    from multigpu.launcher._measure_worker import MeasureDone, _ScriptProbe

    generator, critic = (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1) for _ in range(2))
    written: dict = {}
    probe = _ScriptProbe({"deadline": time.time() + 60, "max_steps": 3}, written.update)
    try:
        with pytest.raises(MeasureDone):
            for _ in range(100):
                time.sleep(0.01)  # the training step's work
                generator.step()
                critic.step()
    finally:
        probe.finish()  # the global hooks go, whatever happened
    assert len(written["step_s"]) == 3 and min(written["step_s"]) >= 0.009
