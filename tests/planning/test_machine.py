"""This machine's planner constants: the low-quantile rule, the cache, the feedback from measured runs, --recalibrate."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from multigpu.cli.main import main
from multigpu.errors import ConfigError
from multigpu.planning import machine
from multigpu.planning.costs import predict_step
from multigpu.planning.measured import Measurement, check
from multigpu.planning.timing import (
    CPU_CLOCK,
    QUANTILE,
    REPEATS,
    SHORT_REPEATS,
    WAIT_QUANTILE,
    low_quantile,
    quantile_s,
)
from multigpu.planning.workload import FsdpLayout, StepCounts, Workload
from tests.planning.machine_constants import FIXED_SOURCE, fixed

TINY = "tests.planning._tiny_model"

# --- the low-quantile rule, on synthetic timings of a 10 ms probe ---------------------------------------


def test_the_kept_timing_ignores_load_on_most_repeats_and_one_lucky_reading() -> None:
    quiet = [0.010, 0.0101, 0.0102]
    loaded = [0.010 * k for k in (3, 5, 2, 4, 6, 2.5)]  # six of nine repeats slowed by other work
    assert low_quantile(quiet + loaded) == pytest.approx(0.0102)
    lucky = [0.002]  # one reading below the machine's floor (a clock hiccup) moves the minimum, not the quantile
    assert low_quantile(lucky + quiet[:2] + loaded) == pytest.approx(0.0101)
    assert min(lucky + quiet[:2] + loaded) == 0.002
    assert (REPEATS, QUANTILE) == (9, 0.25)  # the third fastest of nine, as docs/planning.md says


def test_a_burst_of_load_over_the_median_does_not_reach_the_quantile() -> None:
    timings = [0.010] * 3 + [0.050] * 6
    assert low_quantile(timings) == 0.010
    assert sorted(timings)[len(timings) // 2] == 0.050  # the median would read the burst


def test_a_collective_keeps_the_second_fastest_of_its_short_repeats() -> None:
    # one reading below the rest is kept out (a clock hiccup); the load's slow readings never reach it
    timings = [0.004, 0.010, 0.0102] + [0.010 * k for k in range(2, SHORT_REPEATS - 1)]
    assert len(timings) == SHORT_REPEATS == 25
    assert low_quantile(timings, WAIT_QUANTILE) == 0.010


def test_a_probe_is_timed_by_the_clock_it_is_given() -> None:
    ticks = iter([0.0, 1.0, 1.0, 3.0, 3.0, 3.5])  # a fake clock: the three timed calls read 1, 2 and 0.5
    calls: list[int] = []
    assert quantile_s(lambda: calls.append(1), repeats=3, q=0.0, clock=lambda: next(ticks)) == 0.5
    assert len(calls) == 4  # one warm-up, three timed


def test_a_one_thread_probe_reads_its_thread_cpu_time_not_the_time_it_waited() -> None:
    # the wait stands for the time another process holds the core: wall time sees it, the thread's CPU time not
    wall = quantile_s(lambda: time.sleep(0.02), repeats=3)
    cpu = quantile_s(lambda: time.sleep(0.02), repeats=3, clock=CPU_CLOCK)
    assert wall >= 0.02 and cpu < 0.005


@pytest.mark.parametrize(("values", "q", "match"), [([], 0.25, "no timings"), ([1.0], 1.5, r"q=1.5 must be")])
def test_bad_quantile_input_is_refused(values: list[float], q: float, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        low_quantile(values, q)


# --- the cache, per machine ---------------------------------------------------------------------------


def test_constants_round_trip_through_their_file_and_another_machine_reads_none(tmp_path: Path) -> None:
    constants = fixed().with_feedback({"compute_scale": 1.3})
    path = machine.save(constants, tmp_path)
    assert machine.load(tmp_path, constants.key) == constants
    assert machine.load(tmp_path, constants.key + " (another machine)") is None
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # written whole: no temporary left


@pytest.mark.parametrize("text", ["{", "[]", '{"version": 0}', '{"version": 1, "key": "k"}', "[" * 100_000])
def test_an_unreadable_or_old_cache_file_is_measured_again(tmp_path: Path, text: str) -> None:
    key = fixed().key  # JSON nested past the parser's recursion raised RecursionError out of advise
    machine.cache_path(tmp_path, key).write_text(text)
    assert machine.load(tmp_path, key) is None


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["a named pipe", "a folder", "a file too large"])
def test_something_else_at_the_cache_files_name_is_measured_again_in_bounded_time(tmp_path: Path, kind: str) -> None:
    import os

    path = machine.cache_path(tmp_path, fixed().key)  # a named pipe there: advise waited for a writer forever
    if kind == "a named pipe":
        os.mkfifo(path)
    elif kind == "a folder":
        path.mkdir()
    else:
        path.write_bytes(b" " * (machine.CACHE_LIMIT + 1))
    assert machine.load(tmp_path, fixed().key) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("thread_overhead_s", -1.0),
        ("allreduce_latency_s", float("nan")),
        ("gather_latency_s", float("inf")),
        ("memory_bandwidth", float("inf")),
        ("gather_busbw", True),
        ("feedback", {"compute_scale": [float("inf")]}),
        ("feedback", {"compute_scale": [True]}),
        ("feedback", {"compute_scale": [10**400]}),  # OverflowError out of advise
        ("feedback", ["compute_scale"]),  # AttributeError out of advise
        ("feedback", "compute_scale"),
        ("source", ["measured"]),
        ("host", {"op_s": float("nan")}),
        ("host", {"gil_contention": float("inf")}),
        ("host", {"backward_op_s": float("inf")}),
    ],
)
def test_a_cache_file_holding_a_time_or_bandwidth_no_probe_measures_is_measured_again(
    tmp_path: Path, field: str, value: object
) -> None:
    # json reads NaN and Infinity; a negative or infinite handoff, latency or bandwidth planned every strategy
    # at nonsense (a NaN step compares false with everything, so such a plan ranked first or last at random)
    path = machine.save(fixed(), tmp_path)
    data = json.loads(path.read_text())
    data[field] = {**data["host"], **value} if field == "host" else value  # type: ignore[dict-item]
    path.write_text(json.dumps(data))
    assert machine.load(tmp_path, data["key"]) is None


def test_writers_of_one_cache_file_at_once_each_write_it_whole(tmp_path: Path) -> None:
    # two advise runs in threads of one process (a notebook) shared one partial file named by pid: one renamed
    # it away under the other, whose rename then failed (FileNotFoundError), or renamed a file half-written
    import threading

    errors: list[BaseException] = []

    def write(scale: float) -> None:
        try:
            for _ in range(30):
                machine.save(fixed().with_feedback({"compute_scale": scale}), tmp_path)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=write, args=(1.0 + i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert machine.load(tmp_path, fixed().key) is not None
    assert len(list(tmp_path.iterdir())) == 1


def test_feedback_keeps_the_last_five_and_uses_their_median() -> None:
    constants = fixed()
    for value in (9.0, 1.0, 1.1, 1.2, 0.9, 1.05):
        constants = constants.with_feedback({"compute_scale": value})
    assert constants.feedback["compute_scale"] == [1.0, 1.1, 1.2, 0.9, 1.05]
    assert constants.value("compute_scale") == 1.05
    assert fixed().value("allreduce_busbw") == fixed().allreduce_busbw  # nothing fed back: the probe's figure


def test_an_unknown_fed_back_name_or_value_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"feedback names \['speed'\]"):
        fixed(feedback={"speed": [1.0]})
    with pytest.raises(ConfigError, match=r"feedback\['compute_scale'\]=5 must be a list"):
        fixed(feedback={"compute_scale": 5})
    path = machine.save(fixed(), tmp_path)  # a hand-edited file with such a value is measured again
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "feedback": {"compute_scale": "fast"}}))
    assert machine.load(tmp_path, data["key"]) is None


# --- feedback: each strategy's measured step solves its own constant ------------------------------------


def _workload() -> Workload:
    counts = StepCounts(modules=6, tensors=6, module_calls=6, forward_ops=30, backward_ops=40)
    return Workload(
        name="mlp",
        params=1_585_162,
        compute_s_per_sample=1.2e-4,
        input_bytes_per_sample=2048,
        output_bytes_per_sample=40,
        activation_bytes_per_sample=8232,
        optimizer="sgd-momentum",
        optimizer_s=1e-3,
        counts=counts,
        fsdp=FsdpLayout(groups=(10250, 525312, 1049600)),
    )


def _predicted(constants: machine.MachineConstants, w: Workload, base_scale: float = 1.0) -> dict[str, float]:
    """Each strategy's predicted step from ``constants``, compute scaled as the plan scales it."""
    plat = constants.platform(cores=2, contention=1.3, single_speedup=1.6)
    scaled = replace(w, compute_s_per_sample=w.compute_s_per_sample * constants.value("compute_scale") / base_scale)
    chunks = {"single": [512], "dp": [256, 256], "ddp": [256, 256], "fsdp": [256, 256]}
    return {s: predict_step(s, scaled, plat, chunks=c).total_s for s, c in chunks.items()}


def test_feeding_back_a_measurement_makes_the_next_prediction_that_measurement() -> None:
    constants, w = fixed(), _workload()
    plat = constants.platform(cores=2, contention=1.3, single_speedup=1.6)
    before = _predicted(constants, w)
    # measured: single 10% faster, dp 20% slower, ddp 30% slower, fsdp 60% slower than predicted
    measured = {"single": 0.9 * before["single"], "dp": 1.2 * before["dp"]}
    measured |= {"ddp": 1.3 * before["ddp"], "fsdp": 1.6 * before["fsdp"]}
    rows = [r for r in _rows(w, plat)]
    checked = check(
        rows, [Measurement(strategy=s, devices=1 if s == "single" else 2, step_s=t) for s, t in measured.items()]
    )
    solved = machine.feed_back(constants, w, plat, checked).solved
    assert set(solved) == set(machine.FED_BACK)
    after = _predicted(constants.with_feedback(solved), w)
    for strategy, seconds in measured.items():
        assert after[strategy] == pytest.approx(seconds, rel=0.02), strategy


def test_a_strategy_that_did_not_run_feeds_nothing_back() -> None:
    constants, w = fixed(), _workload()
    plat = constants.platform(cores=2, contention=1.3, single_speedup=1.6)
    failed = Measurement(strategy="ddp", devices=2, status="failed", reason="boom")
    assert machine.feed_back(constants, w, plat, check(_rows(w, plat), [failed])) == machine.FedBack({}, {})


def _measured_at(factor: float, constants: machine.MachineConstants, w: Workload) -> list:
    """Every strategy measured at ``factor`` times its prediction, checked against the plan."""
    plat = constants.platform(cores=2, contention=1.3, single_speedup=1.6)
    before = _predicted(constants, w)
    return check(
        _rows(w, plat),
        [Measurement(strategy=s, devices=1 if s == "single" else 2, step_s=factor * t) for s, t in before.items()],
    )


def test_a_measurement_under_load_is_refused_and_a_quiet_one_fed_back() -> None:
    constants, w = fixed(), _workload()
    plat = constants.platform(cores=2, contention=1.3, single_speedup=1.6)
    checked = _measured_at(1.3, constants, w)  # 30% slower: within the bound, a quiet machine's error
    loaded = machine.feed_back(constants, w, plat, checked, load=3.0)
    assert loaded.solved == {} and set(loaded.refused) == set(machine.FED_BACK)
    assert all("load 3 per core besides the runs (over 0.5)" in why for why in loaded.refused.values())
    assert constants.with_feedback(loaded.solved) == constants  # the cache does not move
    quiet = machine.feed_back(constants, w, plat, checked, load=0.2)
    assert set(quiet.solved) == set(machine.FED_BACK) and quiet.refused == {}
    assert constants.with_feedback(quiet.solved).value("compute_scale") == pytest.approx(1.3, rel=0.02)
    assert machine.feed_back(constants, w, plat, checked, load=None) == quiet  # no load average: the bound only


@pytest.mark.parametrize("factor", [10.0, 0.3])
def test_a_step_beyond_the_bound_of_its_prediction_is_refused(factor: float) -> None:
    # a loaded machine measured 10x the quiet step, which would solve a compute scale of 10
    constants, w = fixed(), _workload()
    plat = constants.platform(cores=2, contention=1.3, single_speedup=1.6)
    fed = machine.feed_back(constants, w, plat, _measured_at(factor, constants, w))
    assert fed.solved == {} and set(fed.refused) == set(machine.FED_BACK)
    assert fed.refused["compute_scale"].startswith(f"single measured {factor:.3g}x its prediction, beyond 2x")
    for value in (1.1, 0.9, 1.2, 1.0):  # four quiet runs, then a loaded one: refused, the median stays
        constants = constants.with_feedback({"compute_scale": value})
    constants = constants.with_feedback(
        machine.feed_back(constants, w, plat, _measured_at(factor, constants, w)).solved
    )
    assert constants.feedback["compute_scale"] == [1.1, 0.9, 1.2, 1.0]
    assert machine.STEP_BOUND == 2.0


def test_the_load_besides_the_runs_is_the_larger_of_before_and_after_less_their_own() -> None:
    assert machine.load_besides(0.4, 2.6, own=2, cores=2) == pytest.approx(0.3)  # the runs' own 2 counted out
    assert machine.load_besides(0.4, 8.0, own=2, cores=2) == pytest.approx(3.0)  # others started meanwhile
    assert machine.load_besides(0.4, 1.0, own=2, cores=2) == pytest.approx(0.2)  # never below what ran before
    assert machine.load_besides(None, None, own=2, cores=2) is None
    assert machine.load_besides(None, 3.0, own=2, cores=2) == pytest.approx(0.5)


def _rows(w: Workload, plat: object) -> list:
    from multigpu.planning.advise import evaluate

    return evaluate(w, plat, [1, 2], global_batch=512)  # type: ignore[arg-type]


# --- the cache from the command line: read, or measured again with --recalibrate -------------------------


def _cpu_plan(tmp_path: Path, *extra: str) -> int:
    argv = ["advise", "--model", f"{TINY}:build", "--input-shape", "32", "--devices", "1,2", "--global-batch", "16"]
    return main([*argv, "--json", "--no-figure", "--out", str(tmp_path / "out"), *extra])


def test_a_cpu_plan_reads_the_cached_constants_and_recalibrate_measures_them_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from multigpu.launcher import machine_probe

    cache = tmp_path / "cache"
    path = machine.save(fixed(allreduce_busbw=1.234e9), cache)
    monkeypatch.setenv("MULTIGPU_CACHE_DIR", str(cache))
    probed: list[bool] = []

    def probe() -> machine.MachineConstants:  # the wiring is checked here; the probe itself below
        probed.append(True)
        return fixed(allreduce_busbw=2.5e9, source="probed")

    monkeypatch.setattr(machine_probe, "probe_machine", probe)
    assert _cpu_plan(tmp_path) == 0
    assert probed == [] and json.loads(path.read_text())["allreduce_busbw"] == 1.234e9
    assert _cpu_plan(tmp_path, "--recalibrate") == 0
    assert probed == [True] and json.loads(path.read_text())["source"] == "probed"
    capsys.readouterr()


def test_without_a_cache_the_machine_is_measured_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from multigpu.launcher import machine_probe

    monkeypatch.setenv("MULTIGPU_CACHE_DIR", str(tmp_path / "empty"))
    probed: list[bool] = []
    monkeypatch.setattr(machine_probe, "probe_machine", lambda: probed.append(True) or fixed(source="probed"))
    assert _cpu_plan(tmp_path) == 0 and _cpu_plan(tmp_path) == 0
    assert probed == [True]
    capsys.readouterr()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_probe_measures_gloo_and_the_host_in_two_processes() -> None:
    from multigpu.launcher.machine_probe import probe_machine

    constants = probe_machine()
    assert constants.key == machine.machine_key() and constants.source != FIXED_SOURCE
    assert 1e7 < constants.allreduce_busbw < 1e12 and 1e7 < constants.gather_busbw < 1e12
    assert 0 <= constants.allreduce_latency_s < 0.1 and 0 <= constants.gather_latency_s < 0.1
    assert 0 < constants.host.fsdp_group_s < 0.1 and constants.host.op_s > 0
    # FSDP2's work per group is read where it shards over two processes: a one-process group shards and
    # copies nothing, and read half of it on the 2 development cores
    from multigpu.planning.calibrate import fsdp_group_s

    assert constants.host.fsdp_group_s > 1.3 * fsdp_group_s(groups=8, repeats=9)
    assert sys.platform != "linux" or constants.fresh_copy_bandwidth < 10 * constants.memory_bandwidth
    # fsdp's processes map each large buffer anew: a page fault per page at least (glibc)
    assert sys.platform != "linux" or constants.fresh_byte_s * 4096 > 1e-8
    assert 0 <= constants.fresh_huge_byte_s <= constants.fresh_byte_s  # a huge page faults once per 2 MiB

    assert 0 <= constants.fresh_alloc_s < 0.01
    # the engines' own cost per step, timed through them (planning/step_floors.py): DDP's beyond its
    # all-reduce, DataParallel's hand-off per replica and phase beyond a bare pool thread's
    from multigpu.planning.calibrate import thread_handoff_s

    # (its all-reduce is timed in sequences, which hold the waits of two processes meeting: 0 on the development cores)
    assert 0 <= constants.ddp_step_s < 0.1
    assert constants.thread_overhead_s > 2 * thread_handoff_s()


def test_fresh_memory_costs_come_apart_from_the_probes_three_sizes() -> None:
    """The two sizes under 2 MiB give the mapping and the 4 KiB pages' rate; the large one, less its first
    2 MiB at that rate, the huge pages' rate (never above the small pages')."""
    from multigpu.launcher.machine_probe import _fresh_costs
    from multigpu.planning import _machine_probe_worker as worker
    from multigpu.planning.costs import SMALL_PAGE_BYTES

    alloc, per_byte, on_huge = 20e-6, 0.4e-9, 0.05e-9
    sizes = {"small": worker.FRESH_SMALL, "mid": worker.FRESH_MID}
    figures = {f"warm_fill_{label}_s": 1e-3 for label in ("small", "mid", "large")}
    figures |= {f"fresh_fill_{label}_s": 1e-3 + alloc + n * per_byte for label, n in sizes.items()}
    figures["fresh_fill_large_s"] = (
        1e-3 + alloc + SMALL_PAGE_BYTES * per_byte + (worker.FRESH_LARGE - SMALL_PAGE_BYTES) * on_huge
    )
    assert _fresh_costs(figures) == pytest.approx((alloc, per_byte, on_huge))
    figures["fresh_fill_large_s"] = 1.0  # a large buffer slower per byte than the small ones: capped at their rate
    assert _fresh_costs(figures)[2] == pytest.approx(per_byte)


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_each_probe_process_is_bound_to_its_share_of_the_cores_as_launched_workers_are() -> None:
    from multigpu.launcher.affinity import core_share
    from multigpu.launcher.machine_probe import _bind
    from tests.launching import start_python

    proc = start_python("-c", "import time; time.sleep(60)")
    try:
        _bind(proc.pid, 1)
        assert os.sched_getaffinity(proc.pid) == core_share(os.sched_getaffinity(0), 1, 2)
        assert os.sched_getaffinity(0) != os.sched_getaffinity(proc.pid)  # the caller stays unbound
    finally:
        proc.kill()
        proc.wait(10)
    _bind(proc.pid, 0)  # a process already gone: nothing to bind, no error (its own failure is reported)


def test_a_cache_folder_that_cannot_be_written_still_plans_and_reports_the_feedback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from multigpu.cli._advise_calibrate import feed_back_measured
    from multigpu.launcher import machine_probe

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("MULTIGPU_CACHE_DIR", str(blocked))
    monkeypatch.setattr(machine_probe, "probe_machine", lambda: fixed(source="probed"))
    assert _cpu_plan(tmp_path) == 0
    w = _workload()
    plat = fixed().platform(cores=2, contention=1.0, single_speedup=1.0)
    single = Measurement(strategy="single", devices=1, step_s=0.05)
    fed, where = feed_back_measured(w, plat, check(_rows(w, plat), [single]))
    assert set(fed.solved) == {"compute_scale"} and where.startswith("not written") and "MULTIGPU_CACHE_DIR" in where
    capsys.readouterr()


def test_fsdp_work_per_group_holds_the_waits_at_its_collectives_beyond_their_latency() -> None:
    from multigpu.launcher.machine_probe import _fsdp_group_s

    figures = {
        "fsdp_step_plain_s": 0.001,
        "fsdp_step_sharded_s": 0.010,
        "fsdp_step_plain_wall_s": 0.001,
        "fsdp_step_sharded_wall_s": 0.019,
    }
    # 8 blocks and the root: 9 groups, 24 collectives. Wall: 18 ms less 24 x 0.25 ms of latency = 12 ms;
    # the thread's CPU time: 9 ms. The larger, per group.
    assert _fsdp_group_s(figures, 2.5e-4) == pytest.approx(12e-3 / 9)
    assert _fsdp_group_s(figures, 1e-3) == pytest.approx(9e-3 / 9)  # the latency explains the waits: CPU time


def test_feedbacks_written_at_once_each_land_in_the_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # two `advise --measure` runs (or threads) feeding back at once: each read the cache, appended its value and
    # renamed its copy over the file, so one rename between another's read and rename dropped that one's value
    import threading

    from multigpu.cli._advise_calibrate import feed_back_measured

    monkeypatch.setenv("MULTIGPU_CACHE_DIR", str(tmp_path))
    w = _workload()
    plat = fixed().platform(cores=2, contention=1.0, single_speedup=1.0)
    predicted = _predicted(fixed(), w)["single"]
    writers, rounds = 4, 5
    for _ in range(rounds):
        machine.save(fixed(), tmp_path)
        start, errors = threading.Barrier(writers), list[BaseException]()

        def feed(i: int, start: threading.Barrier, errors: list[BaseException]) -> None:
            single = Measurement(strategy="single", devices=1, step_s=predicted * (1.0 + 0.05 * i))
            checked = check(_rows(w, plat), [single])
            start.wait()
            try:
                feed_back_measured(w, plat, checked)
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=feed, args=(i, start, errors)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        landed = machine.load(tmp_path, fixed().key)
        assert landed is not None and len(landed.feedback["compute_scale"]) == writers
    assert sorted(p.name for p in tmp_path.iterdir()) == [machine.cache_path(tmp_path, fixed().key).name]


def test_a_recalibration_saved_while_a_feedback_is_written_is_not_overwritten_by_it(tmp_path: Path) -> None:
    # advise --recalibrate saved its fresh constants between a feedback's read and its rename, which then wrote
    # the old constants (with its value) back over them: the recalibration was lost
    import threading

    machine.save(fixed(), tmp_path)
    inside, errors = threading.Event(), list[BaseException]()

    def solve(latest: machine.MachineConstants) -> dict[str, float]:
        inside.set()
        time.sleep(0.5)  # the recalibration's save comes now
        return {"compute_scale": 1.5}

    def feed() -> None:
        try:
            machine.record_feedback(tmp_path, fixed(), solve)
        except BaseException as error:
            errors.append(error)

    feeding = threading.Thread(target=feed)
    feeding.start()
    assert inside.wait(10)
    machine.save(fixed(source="recalibrated"), tmp_path)  # waits for the feedback's turn to end
    feeding.join()
    assert errors == []
    landed = machine.load(tmp_path, fixed().key)
    assert landed is not None and landed.source == "recalibrated" and landed.feedback == {}


def test_a_partial_a_killed_writer_left_beside_the_cache_is_removed_by_the_next_save(tmp_path: Path) -> None:
    path = machine.cache_path(tmp_path, fixed().key)
    stale = path.with_name(f"{path.name}.999999.1.tmp")  # killed between its write and its rename
    stale.write_text("{")
    machine.save(fixed(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
