"""Measure strategies on this machine, one process each, within a time budget (``multigpu advise --measure``).

Each strategy runs :mod:`multigpu.launcher._measure_worker` in processes of its own, as a real run
would start: ``ddp`` and ``fsdp`` through ``multigpu launch --strategy S --nproc-per-node N`` (torchrun,
the launcher's environment, its failure summary), ``single`` and ``dp`` as one plain process with the
environment ``multigpu launch`` gives one (:func:`multigpu.launcher.environment.worker_env`). They run one
after another, never together (they would share the cores). A run that fails (an exception, out of
memory, killed) is reported with the last line of its error and the others still run; a run past its
share of the budget is killed with everything it started.

The budget: each run may take the budget left divided by the runs left, up to twice that when the
earlier runs ended early enough to leave it; the worker times steps until 80% of its share, so start-up
and teardown fit. The planner compares the results with its predictions
(:mod:`multigpu.planning.measured`).

Example:
    >>> runs = [MeasureRun(strategy="single", devices=1, global_batch=32)]   # doctest: +SKIP
    >>> measure(runs, MeasureSpec(factory="mynet:build", input_shape=[512]), budget_s=30)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from multigpu.core.limits import DAY_S, check_seconds
from multigpu.core.run_files import UnreadableFile, entries, read_bytes, read_json, read_tail
from multigpu.errors import ConfigError
from multigpu.launcher import _measure_worker
from multigpu.launcher.config import LaunchConfig
from multigpu.launcher.environment import inherited, worker_env
from multigpu.launcher.process_groups import end_sessions, exit_status
from multigpu.planning.measured import Measurement
from multigpu.planning.timing import low_quantile
from multigpu.runtime import peers
from multigpu.strategies import get_strategy

MAX_STEPS = 40  # timed steps at most per strategy
# The step reported: the low quantile (multigpu.planning.timing.QUANTILE, the 25th percentile) of the timed
# steps, as the planner's probes keep theirs: other processes only add time to a step, and on the 2
# development cores the median of 20 moved 20-50% between quiet runs an hour apart.
_TIMING_SHARE = 0.8  # of a run's share of the budget, spent before its worker stops timing
_KILL_GRACE_S = 5.0
_LOG_BYTES = 1 << 20  # of a run's output: the end, where the error is
_REPORT_BYTES = 16 << 20  # a worker's report: per-step times and samples, a few KiB per thousand steps
_OOM = re.compile(r"out of memory|OutOfMemoryError|MemoryError|Cannot allocate memory", re.IGNORECASE)
_ERROR_LINE = re.compile(r"^\s*([\w.]*(Error|Exception|Interrupt)\b.*)$")


@dataclass(frozen=True, kw_only=True)
class MeasureRun:
    """One strategy at one device count; ``global_batch`` is the factory's step (a script picks its own)."""

    strategy: str
    devices: int
    global_batch: int = 0


@dataclass(kw_only=True)
class MeasureSpec:
    """What every run trains: a model factory with its inputs, or a Session script.

    Attributes:
        factory: ``package.module:function`` returning an ``nn.Module``; or None with ``script``.
        input_shape: the per-sample input shape of the factory's model.
        input_dtype: torch dtype name of the inputs (``float32``, ``int64`` for token ids).
        optimizer: ``sgd``, ``sgd-momentum``, ``adam`` or ``adamw`` (the factory's).
        script: a training script using :class:`multigpu.Session` (instead of a factory).
        script_args: its arguments.
        max_steps: timed steps at most per run.
    """

    factory: str | None = None
    input_shape: list[int] = field(default_factory=list)
    input_dtype: str = "float32"
    optimizer: str = "adam"
    script: str | None = None
    script_args: list[str] = field(default_factory=list)
    max_steps: int = MAX_STEPS

    def __post_init__(self) -> None:
        if (self.factory is None) == (self.script is None):
            raise ConfigError(
                "measure a model factory (--model package.module:factory) or a script (--script), one of them"
            )
        if self.script is not None and not os.path.isfile(self.script):
            raise ConfigError(f"--script {self.script!r} does not exist; pass the path of a Python file")
        if self.max_steps < 1:
            raise ConfigError(f"max_steps={self.max_steps} must be >= 1")


Progress = Callable[[MeasureRun, float, float], None]
"""Told (run, seconds into this run, its share) while a run is in progress, and once at its end."""


def measure(
    runs: Sequence[MeasureRun], spec: MeasureSpec, *, budget_s: float, progress: Progress | None = None
) -> list[Measurement]:
    """Run each strategy in its own process(es), one after another, within ``budget_s`` seconds in all.

    Returns:
        One :class:`Measurement` per run, in order: ``ok`` with the 25th-percentile step, or failed / out of
        memory / timed out with the reason.

    Raises:
        ConfigError: a budget that is not a positive number of seconds.
    """
    budget_s = check_seconds(budget_s, "budget_s (advise --budget)", maximum_s=DAY_S)
    end = time.monotonic() + budget_s
    results = []
    for i, run in enumerate(runs):
        left = end - time.monotonic()
        share = left / (len(runs) - i)
        if share < 1.0:
            results.append(
                Measurement(strategy=run.strategy, devices=run.devices, status="not run", reason="budget spent")
            )
            continue
        results.append(_measure_one(run, spec, share=share, limit=min(left, 2 * share), progress=progress))
    return results


def _argv(run: MeasureRun, spec_path: Path) -> tuple[list[str], dict[str, str]]:
    worker = _measure_worker.__file__
    if get_strategy(run.strategy).needs_processes:
        argv = [sys.executable, "-m", "multigpu", "launch", "--strategy", run.strategy]
        argv += ["--nproc-per-node", str(run.devices), "--grace-period", str(_KILL_GRACE_S), worker, str(spec_path)]
        return argv, dict(os.environ)
    devices = _dp_devices(run.devices) if get_strategy(run.strategy).launch_devices else None
    env = {**inherited(os.environ), **worker_env(LaunchConfig(strategy=run.strategy, devices=devices), run.strategy, 1)}
    return [sys.executable, worker, str(spec_path)], env


def _dp_devices(n: int) -> str:
    from multigpu.devices import process_device_type

    return process_device_type().replicas_spec(n)  # the type the launched workers compute on: the same devices


def _measure_one(
    run: MeasureRun, spec: MeasureSpec, *, share: float, limit: float, progress: Progress | None
) -> Measurement:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"multigpu-measure-{run.strategy}-") as folder:
        spec_path = Path(folder) / "spec.json"
        payload = {
            **asdict(spec),
            "strategy": run.strategy,
            "devices": _dp_devices(run.devices) if get_strategy(run.strategy).launch_devices else None,
            "global_batch": run.global_batch,
            "folder": folder,
            "deadline": time.time() + _TIMING_SHARE * share,
        }
        spec_path.write_text(json.dumps(payload))
        argv, env = _argv(run, spec_path)
        log = Path(folder) / "output.txt"
        with log.open("w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                timed_out = _wait(proc, run, started, share, limit, progress)
            finally:  # past its share, Ctrl-C here (its own session does not get the terminal's signal), any
                # error, or a run that left helpers behind: end its session; the launcher forwards the SIGTERM to
                # its workers and kills them after its own grace period (_KILL_GRACE_S), so it gets 5 s more
                end_sessions([proc.pid], grace_s=_KILL_GRACE_S + 5.0)
                proc.wait()
                _kill_workers(Path(folder), spec_path)  # in sessions of their own (torch elastic): not in proc's group
        wall = time.monotonic() - started
        if progress is not None:
            progress(run, wall, share)
        if timed_out:
            reason = f"did not finish within its {limit:.0f} s of the budget (raise --budget)"
            return _failed(run, wall, "timed out", reason)
        return _outcome(run, wall, proc.returncode, Path(folder))


def _outcome(run: MeasureRun, wall: float, returncode: int, folder: Path) -> Measurement:
    """What a finished run's output and its workers' reports in ``folder`` say (garbage there: failed, by name)."""
    text = read_tail(folder / "output.txt", keep=_LOG_BYTES)  # the output may be endless: its end says why
    ranks, unreadable = _reports(folder)
    if returncode != 0 or not ranks:
        return _failed(run, wall, _failure_kind(returncode, text), _reason(returncode, text))
    if unreadable:
        return _failed(run, wall, "failed", f"unreadable report {unreadable[0]}")
    try:
        return _combine(run, wall, ranks)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:  # not what the worker writes
        return _failed(run, wall, "failed", f"a worker's report is not what it writes ({type(exc).__name__}: {exc})")


def _reports(folder: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The workers' reports in ``folder`` (bounded, regular files, mappings), and ``"path: why"`` of the others."""
    ranks: list[dict[str, Any]] = []
    unreadable: list[str] = []
    for path in entries(folder, "rank*.json"):
        try:
            data = read_json(path, limit=_REPORT_BYTES)
            if not isinstance(data, dict):
                raise UnreadableFile(f"it holds a {type(data).__name__} where the worker writes a mapping")
            ranks.append(data)
        except UnreadableFile as exc:
            unreadable.append(f"{path}: {exc}")
    return ranks, unreadable


def _failed(run: MeasureRun, wall: float, status: str, reason: str) -> Measurement:
    return Measurement(strategy=run.strategy, devices=run.devices, status=status, reason=reason, wall_s=wall)


def _wait(
    proc: subprocess.Popen[bytes],
    run: MeasureRun,
    started: float,
    share: float,
    limit: float,
    progress: Progress | None,
) -> bool:
    """Wait for ``proc`` until ``limit`` seconds after ``started``; True when it was still running then.

    It is left unreaped, so its pid names its session until :func:`end_sessions` has swept it."""
    while exit_status(proc.pid) is None:
        elapsed = time.monotonic() - started
        if progress is not None:
            progress(run, elapsed, share)
        if elapsed > limit:
            return True
        time.sleep(0.2)
    return False


def _kill_workers(folder: Path, spec_path: Path) -> None:
    """SIGKILL the session of every worker that wrote its pid into ``folder`` and still runs (a worker
    that ignored SIGTERM outlives its launcher: torch elastic starts workers in sessions of their own).

    Only a group that proves to be one of this measurement's workers (``spec_path`` in its command line,
    the recorded start time: :func:`multigpu.runtime.peers.signal_group`): a pid file is a file, and a
    pid of 0, 1 or -1 there would have killed this process's group or every process on the machine.
    """
    for record in entries(folder, "pid*"):
        with contextlib.suppress(UnreadableFile, ValueError):
            pid, start = (int(part) for part in read_bytes(record, limit=64).split())
            peers.signal_group(pid, signal.SIGKILL, start=start, argument=str(spec_path))


def _failure_kind(returncode: int | None, text: str) -> str:
    """``out of memory`` when the output says so or the kernel killed it (SIGKILL), else ``failed``."""
    if _OOM.search(text) or returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "out of memory"
    return "failed"


def _reason(returncode: int | None, text: str) -> str:
    """The last line that names an exception, else the last line of output, with the exit code."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [m.group(1) for line in lines if (m := _ERROR_LINE.match(line))]
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) and not errors:
        return f"killed (SIGKILL, exit {returncode}): likely the system's out-of-memory killer"
    last = errors[-1] if errors else (lines[-1] if lines else "no output")
    return f"{last[:300]} (exit {returncode})"


def _combine(run: MeasureRun, wall: float, ranks: list[dict[str, Any]]) -> Measurement:
    """The ranks' reports as one row: per step the slowest rank's time and every rank's samples."""
    steps = min(len(r["step_s"]) for r in ranks)
    if steps == 0:
        return _failed(run, wall, "failed", "no timed step: the script ended before its warm-up was over")
    per_step = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    samples = [sum(r["samples"][i] for r in ranks) for i in range(steps)]
    peaks = [int(b) for r in ranks for b in r["peak_bytes"]]
    return Measurement(
        strategy=run.strategy,
        devices=run.devices,
        wall_s=wall,
        step_s=low_quantile(per_step),
        samples_per_step=int(statistics.median(samples)) or None,
        steps=steps,
        peak_bytes=peaks,
        memory_source=str(ranks[0].get("memory_source", "")),
    )
