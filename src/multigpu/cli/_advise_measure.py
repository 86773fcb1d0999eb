"""``multigpu advise --measure``: the plan, then every strategy that fits the devices present timed here.

    multigpu advise --measure --model mynet:build --input-shape 3,32,32 --budget 60
    multigpu advise --measure --script train.py --script-args "--epochs 1" --json

The device counts are those of ``--devices`` that this machine has, by default 1 and every device
present (on a CPU, 2: as ``multigpu launch`` starts ddp there). At one device ``single`` runs; at N,
``dp`` (``cpu:N`` or N GPUs), ``ddp`` and ``fsdp`` with N processes (``--strategies`` picks fewer).
Each runs in its own process(es) (:mod:`multigpu.launcher.measure`); the planner sets the measured
rows beside its predictions (:mod:`multigpu.planning.measured`).
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import TYPE_CHECKING, Any

from multigpu.cli._advise_plan import INPUT_DTYPES, batch_flags, build_plan, parse_shape, plan_inputs, write_result
from multigpu.core.lookup import lookup
from multigpu.errors import ConfigError, MultigpuError

if TYPE_CHECKING:
    from rich.console import Console

    from multigpu.launcher.measure import MeasureRun, MeasureSpec
    from multigpu.planning.advise import Row


def devices_present() -> int:
    """Devices a measured run may use here: every GPU, else the processes ``multigpu launch`` starts on a CPU."""
    from multigpu.launcher.config import LaunchConfig
    from multigpu.launcher.torchrun import resolve_nproc

    return resolve_nproc(LaunchConfig())


def present_accelerator() -> str | None:
    """``"cuda"`` (or another type) when the measured runs compute on an accelerator here, else None."""
    from multigpu.devices import process_device_type

    kind = process_device_type().name  # what launch_measured's processes and dp replicas run on
    return None if kind == "cpu" else kind


def device_counts(args: argparse.Namespace, present: int) -> list[int]:
    """``--devices`` limited to what is present; by default ``1`` and every device present."""
    if args.devices is None:
        return sorted({1, present})
    asked = list(parse_shape(args.devices, flag="--devices") or ())
    counts = sorted({n for n in asked if n <= present})
    if not counts:
        raise ConfigError(
            f"--devices {args.devices}: this machine has {present} devices to measure on; pass e.g. 1,{present}"
        )
    return counts


def strategies(args: argparse.Namespace) -> list[str]:
    """``--strategies`` (default: every strategy of the registry), refused by name when one is not a strategy."""
    from multigpu.strategies.registry import strategy_names

    measured = strategy_names()
    chosen = [s.strip() for s in (args.strategies or ",".join(measured)).split(",") if s.strip()]
    message = "--strategies {value!r}: pick from {choices}, e.g. single,ddp"
    for name in chosen or [""]:  # none at all is refused as a name that is not there
        lookup(dict.fromkeys(measured), name, message, shown=args.strategies)
    return chosen


def build_runs(counts: list[int], chosen: list[str], rows: list[Row], batch: dict[str, Any]) -> list[MeasureRun]:
    """A run per strategy and device count: one of a device (``single``) at one device, the others at more;
    the predicted row's batch when there is one, else the batch flags'."""
    from multigpu.launcher.measure import MeasureRun
    from multigpu.strategies.registry import get_strategy

    predicted = {(r.strategy, r.devices): sum(r.step.chunks) for r in rows}
    runs = []
    for n in counts:
        for strategy in chosen:
            if get_strategy(strategy).multi_device != (n > 1):
                continue
            default = batch.get("global_batch") or batch.get("per_device_batch", 32) * n
            runs.append(MeasureRun(strategy=strategy, devices=n, global_batch=predicted.get((strategy, n), default)))
    if not runs:
        raise ConfigError(
            f"--strategies {','.join(chosen)} has nothing to run at {counts} devices; add single or a count > 1"
        )
    return runs


def measure_spec(args: argparse.Namespace) -> MeasureSpec:
    from multigpu.launcher.measure import MeasureSpec

    factory = args.model if args.model and ":" in args.model else None
    shape = list(parse_shape(args.input_shape) or ()) if factory else []
    if factory and not shape:
        raise ConfigError(
            f"--model {args.model!r} is measured on random inputs: pass --input-shape, e.g. 512 or 3,224,224"
        )
    return MeasureSpec(
        factory=None if args.script else factory,
        input_shape=shape,
        input_dtype=INPUT_DTYPES.get(args.input_dtype, args.input_dtype),
        optimizer=args.optimizer,
        script=args.script,
        script_args=shlex.split(args.script_args or ""),
    )


def _progress_bar(console: Console) -> Any:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console, transient=True)


class _RunClock:
    """Seconds of the runs that ended plus the one in progress (the progress bar's position)."""

    def __init__(self) -> None:
        self.run: MeasureRun | None = None
        self.ended_s = 0.0
        self.last_s = 0.0

    def total(self, run: MeasureRun, seconds: float) -> float:
        if run is not self.run:
            self.ended_s += self.last_s
            self.run = run
        self.last_s = seconds
        return self.ended_s + seconds


def run_measure(args: argparse.Namespace, console: Console) -> int:
    """Plan (when a factory model is given), measure each strategy, print or emit JSON; 2 on bad input."""
    from rich.console import Console as RichConsole

    from multigpu.launcher.measure import measure
    from multigpu.planning.advise import print_plan, recommend, to_json
    from multigpu.planning.machine import load_besides
    from multigpu.planning.measured import check, measured_json, plot_measured, print_measured, recommend_measured

    try:
        if args.script and args.model and ":" not in args.model:
            raise ConfigError(f"--model {args.model!r} with --script must be a factory (package.module:function)")
        spec = measure_spec(args)
        present = devices_present()
        counts = device_counts(args, present)
        chosen = strategies(args)
        plan: dict[str, Any] = {"inputs": {"script": args.script}, "rows": [], "recommendation": None}
        rows: list[Row] = []
        planned: tuple[Any, Any] | None = None  # the CPU plan's workload and platform, for the feedback
        batch = batch_flags(args)
        if args.model:
            args.devices = ",".join(map(str, counts))
            w, plat, rows, batch = build_plan(args)
            planned = (w, plat) if _plans_what_runs(args) else None
            rec = recommend(rows, plat.memory_bytes)
            plan = to_json(rows, rec, plan_inputs(w, plat, rows, batch))
            if not args.json:
                print_plan(console, w, plat, rows, rec)
                if args.gpu is None and args.gpu_tflops is None and present_accelerator() is not None:
                    console.print(
                        f"(the plan above is for this machine's CPU; the runs below use its {present_accelerator()} "
                        "devices: pass --gpu PRESET and --link for their plan)",
                        soft_wrap=True,
                    )
        runs = build_runs(counts, chosen, rows, batch)
    except (MultigpuError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        return 2
    with _progress_bar(RichConsole(stderr=True)) as bar:
        task = bar.add_task("measuring", total=args.budget)
        shown = _RunClock()

        def told(run: MeasureRun, seconds: float, share: float) -> None:
            bar.update(
                task,
                completed=min(args.budget, shown.total(run, seconds)),
                description=f"measuring {run.strategy} x{run.devices}",
            )

        before = _load_average()
        measurements = measure(runs, spec, budget_s=args.budget, progress=told)
    load = load_besides(before, _load_average(), own=max(r.devices for r in runs), cores=os.cpu_count() or 1)
    checked = check(rows, measurements)
    rec_measured = recommend_measured(checked)
    result_json = {**plan, "measured": measured_json(checked, rec_measured, args.budget)}
    fed_back = _feed_back(planned, checked, load)
    if fed_back is not None:
        result_json["measured"]["fed_back"] = fed_back
    title = f"{args.model or args.script}: measured here"
    written = write_result(args, result_json, lambda out: plot_measured(checked, out / "advise-measured.png", title))
    if written is not None:
        print_measured(console, checked, rec_measured, args.budget)
        if fed_back is not None:
            solved = ", ".join(f"{k} {v:.3g}" for k, v in fed_back["constants"].items()) or "nothing"
            console.print(f"fed back into this machine's constants ({fed_back['file']}): {solved}", soft_wrap=True)
            for name, why in fed_back["refused"].items():
                console.print(f"not fed back: {name}: {why}", soft_wrap=True)
        console.print(written, soft_wrap=True)
    return 0


def _plans_what_runs(args: argparse.Namespace) -> bool:
    """The plan is this CPU's, the runs compute on it and train the factory's model at the planned batch
    (not a script's own): their times may correct its constants."""
    return (
        args.script is None
        and args.gpu is None
        and args.gpu_tflops is None
        and args.busbw is None
        and present_accelerator() is None
    )


def _load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _feed_back(planned: tuple[Any, Any] | None, checked: list[Any], load: float | None) -> dict[str, Any] | None:
    """The measured steps solved into this machine's cached constants (None: not a CPU plan of what ran)."""
    if planned is None:
        return None
    from multigpu.cli._advise_calibrate import feed_back_measured

    fed, path = feed_back_measured(*planned, checked, load=load)
    return {"constants": fed.solved, "refused": fed.refused, "load_per_core": load, "file": path}
