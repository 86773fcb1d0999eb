"""Profile a few steps of your own training script and write a report folder.

    multigpu profile train.py --lr 0.1                   # 1 warm-up + 5 steps, report in profile-out/
    multigpu profile --steps 10 --out prof --trace train.py

The script runs as ``__main__`` with its own arguments, unchanged. One step ends at each
``optimizer.step()``; after --warmup + --steps steps the script is stopped and the report written:
a summary table here, and in --out: summary.txt, profile.json, phases.png (stacked time per
phase per device), bandwidth.png (this run's communication against probe curves up to
--probe-max-size), memory.png (with --memory: peak memory per device) and, with --trace, a Chrome
trace (trace.json, open in chrome://tracing or ui.perfetto.dev) with the phases named.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multigpu.errors import ConfigError, MultigpuError

if TYPE_CHECKING:
    from multigpu.profiling.records import StepProfile

# torch and the library are imported inside the functions that run the command: building the
# parser (every command, also `multigpu --help`) must not pay for them (tests/cli/test_startup.py)

HELP = "run a few steps of a training script and report time per phase and device, bytes moved and bandwidth"


class _StopScript(BaseException):
    """Raised from the optimizer hook once enough steps are kept (BaseException: user code's
    ``except Exception`` does not swallow it)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps",
        type=int,
        default=5,
        help="steps to keep (default 5); the script is stopped after --warmup + --steps steps, and one that ends "
        "sooner is reported as far as it ran, with a note giving both counts",
    )
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and not kept (default 1)")
    parser.add_argument("--out", default="profile-out", help="report folder (default profile-out)")
    parser.add_argument("--trace", action="store_true", help="also write a Chrome trace through torch.profiler")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also measure per-device peak memory per step (CPU devices: an allocation tracker that slows "
        "every op, so read the times of such a run as relative only; CUDA: the allocator's statistics)",
    )
    parser.add_argument(
        "--no-probe", action="store_true", help="skip the bandwidth probes drawn under this run's transfers"
    )
    parser.add_argument("--probe-max-size", default="64MiB", help="largest probe message (default 64MiB)")
    parser.add_argument("script", help="the training script (a .py file)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from multigpu.profiling.bandwidth import parse_size
    from multigpu.report.folder import write_profile_report

    console = Console()
    try:
        profile, trace = _profile_script(args)
        points = [] if args.no_probe else _probe_like(profile, parse_size(args.probe_max_size))
    except MultigpuError as exc:
        print(f"error: {exc}", file=sys.stderr)  # plain: an error message must not wrap
        return 2
    files = write_profile_report(args.out, profile, bandwidth=points, console=console, memory_hint="--memory")
    if trace is not None:
        files.append(Path(args.out) / "trace.json")
        trace.export_chrome_trace(str(files[-1]))
    if len(profile.steps) < args.steps:  # the script ended first: the report is smaller than asked, say so
        ran = args.warmup + len(profile.steps)
        print(
            f"note: {args.script} ended after {ran} steps, before the {args.warmup + args.steps} asked "
            f"(--warmup {args.warmup} + --steps {args.steps}): the report covers {len(profile.steps)} kept steps, "
            f"not {args.steps}",
            file=sys.stderr,  # plain: a note must not wrap
        )
    console.print(_throughput_line(profile.meta["throughput"]))
    console.print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _profile_script(args: argparse.Namespace) -> tuple[StepProfile, Any]:
    from multigpu.cli._profile_throughput import ScriptWatch
    from multigpu.core.script import run_as_main
    from multigpu.profiling.memory import track_memory
    from multigpu.profiling.step import ProfileConfig, profile_steps

    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: keep at least one step, e.g. --steps 5")
    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"script {str(script)!r} is not a file; give the path of your training script")

    watch = ScriptWatch()  # samples and the model, for step time, samples/s and MFU

    def stop_when_done(kept: int) -> None:
        watch.on_step(kept)
        if kept >= args.steps:
            raise _StopScript

    config = ProfileConfig(warmup=args.warmup, trace_ranges=args.trace)
    memory = track_memory() if args.memory else None
    with (
        watch,
        _maybe_trace(args.trace) as trace,
        profile_steps(config=config, memory=memory, on_step=stop_when_done) as profiler,
    ):
        try:
            run_as_main(script, args.args)
        except _StopScript:
            pass
        except SystemExit as exc:  # the script ended itself (sys.exit): report what ran, unless it failed
            if exc.code not in (None, 0):
                raise
    profile = profiler.profile()
    if not profile.steps:
        raise ConfigError(
            f"{script} finished after {profiler.steps_run} steps, before a step was kept (--warmup {args.warmup} "
            f"+ --steps {args.steps} asked): a step ends at each optimizer.step(); lower --warmup or let the "
            "script run longer"
        )
    profile.meta["script"] = str(script)
    profile.meta["throughput"] = watch.figures(profile)  # what session.log adds, in profile.json
    return profile, trace


def _throughput_line(figures: dict[str, float]) -> str:
    """The figures session.log adds, as one line: step time, samples/s, MFU (those known)."""
    parts = [f"step {figures['step_time_s'] * 1e3:.2f} ms (median)"]
    if "samples_per_s" in figures:
        parts.append(f"{figures['samples_per_s']:,.0f} samples/s")
    if "mfu" in figures:
        parts.append(f"MFU {figures['mfu']:.2%}")
    return "Throughput: " + ", ".join(parts)


@contextlib.contextmanager
def _maybe_trace(enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    import torch

    from multigpu.devices import accelerator_type, get_device_type

    activities = [torch.profiler.ProfilerActivity.CPU]
    accel = accelerator_type()
    activity = get_device_type(accel).profiler_activity if accel is not None else None
    if activity is not None and hasattr(torch.profiler.ProfilerActivity, activity):
        activities.append(getattr(torch.profiler.ProfilerActivity, activity))
    with torch.profiler.profile(activities=activities) as trace:
        yield trace


def _probe_like(profile: StepProfile, max_bytes: int) -> list[Any]:
    """Copy and broadcast/reduce probes over the sizes this run moved (for the bandwidth figure)."""
    from multigpu.profiling.bandwidth import message_sizes, probe_local, replica_devices_from_labels

    moved = [s.nbytes for s in profile.comm_stats()]
    if not moved or len(profile.devices) < 2:
        return []
    low = max(1024, 1 << (min(moved).bit_length() - 1))
    high = min(max_bytes, 1 << max(moved).bit_length())
    sizes = message_sizes(low, max(low, high), 4)
    points, _ = probe_local(sizes, replica_devices_from_labels(profile.devices), repeats=3)
    return points
