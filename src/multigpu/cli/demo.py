"""Train a small CNN on scikit-learn's handwritten digits on one device, with multigpu.DataParallel
on the available devices (every GPU, else "cpu:2"), with balanced DataParallel, and with DDP
through 'multigpu launch' (one process per GPU, else 2): the same seed, data order and global
batch for every run. Print a table; write the loss curves and per-device memory as PNGs.

    multigpu demo                       # about a minute on a 2-core machine
    multigpu demo --devices cpu:4 --epochs 3 --out demo-out
    multigpu demo --dtype float64       # every run ends on the one-device weights to ~1e-15

Every run gets the same warm-up (a few untimed steps on a throwaway model first, and its own
first steps left out of samples/s), so that no run's speed includes the process's cold start.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from multigpu.cli._numbers import count, real
from multigpu.core.limits import process_bound
from multigpu.errors import MultigpuError

if TYPE_CHECKING:
    from rich.table import Table

    from multigpu.demo.train import Plan, RunResult

# torch and the demo are imported when the command runs, so that building the parser stays
# cheap; TrainConfig's defaults are written here (tests/cli/test_startup.py checks they match)
_DEFAULTS = {"epochs": 10, "batch_size": 128, "lr": 0.03, "seed": 0, "dtype": "float32"}

HELP = "train a digits CNN on one device, with DataParallel and with DDP, then report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices",
        default=None,
        help="devices for the parallel runs: 'cpu:2', 'cuda:0,1', ... (default: every GPU, else cpu:2)",
    )
    parser.add_argument(
        "--epochs",
        type=count(1, 10_000, "an epoch count"),
        default=_DEFAULTS["epochs"],
        help="passes over the training images (default %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=count(1, None, "a batch size"),
        default=_DEFAULTS["batch_size"],
        help="global batch size, split across the replicas (default %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=real(0, 1e3, "a learning rate"),
        default=_DEFAULTS["lr"],
        help="SGD learning rate, momentum 0.9 (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=count(0, 2**63 - 1, "a seed"),
        default=_DEFAULTS["seed"],
        help="seed for weights and data order (default %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default=_DEFAULTS["dtype"],
        help="float64 shows that what separates the runs' weights is float32 rounding",
    )
    parser.add_argument(
        "--ddp-processes",
        type=_ddp_processes,
        default="auto",
        metavar="N",
        help="processes of the DDP run through 'multigpu launch' ('auto': one per GPU, else 2; 0 skips it)",
    )
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="folder for the PNG figures")


def _ddp_processes(text: str) -> str:
    return text if text == "auto" else str(count(0, process_bound(), "a process count (0 skips the DDP run)")(text))


def default_devices() -> str:
    """Every device of the type ddp's workers compute on (every GPU) when there are several, else two CPU replicas."""
    from multigpu.devices import get_device_type, several_accelerators

    return (several_accelerators() or get_device_type("cpu")).default_devices()


def build_plans(devices: str, primary: str) -> list[Plan]:
    """The runs of the demo: the one-device oracle, standard DataParallel, balanced DataParallel."""
    from torch import nn

    from multigpu.demo.train import Plan
    from multigpu.devices import parse_devices
    from multigpu.parallel import DataParallel

    criterion = nn.CrossEntropyLoss()
    replicas = f"{len(parse_devices(devices))} replicas"
    return [
        Plan("one device", primary, lambda m: m.to(primary)),
        Plan(f"DataParallel, {replicas}", devices, lambda m: DataParallel(m.to(primary), devices=devices)),
        Plan(
            f"DataParallel, balanced, {replicas}",
            devices,
            lambda m: DataParallel(m.to(primary), devices=devices, loss_fn=criterion, chunk_sizes="auto"),
            loss_on_replicas=True,
        ),
    ]


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from multigpu.demo.data import load_digits
    from multigpu.demo.ddp import run_ddp
    from multigpu.demo.figures import plot_losses, plot_memory
    from multigpu.demo.train import Plan, TrainConfig, steps_per_run, train_run, warm_up
    from multigpu.devices import parse_devices

    console = Console(width=None if sys.stdout.isatty() else 124)
    devices = args.devices or default_devices()
    try:
        primary = str(parse_devices(devices)[0].device)  # the oracle's device: DataParallel's primary
        config = TrainConfig(
            epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed, dtype=args.dtype
        )
    except MultigpuError as exc:  # before anything trains: a message, not a traceback
        print(f"multigpu demo: {exc}", file=sys.stderr)
        return 2
    data = load_digits(seed=args.seed).to(primary)
    plans = build_plans(devices, primary)
    console.print(
        f"[bold]multigpu demo[/]: digits CNN, {len(data.train_y)} train / {len(data.test_y)} test images, "
        f"global batch {config.batch_size}, {config.epochs} epochs, {config.dtype}, devices {devices}"
    )
    runs: list[RunResult] = []
    with Progress(
        TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("warm-up (every run, untimed)", total=len(plans))
        for plan in plans:
            warm_up(plan, data, config)
            progress.advance(task)
        for plan in plans:
            task = progress.add_task(plan.name, total=steps_per_run(data, config))
            runs.append(train_run(plan, data, config, on_step=partial(progress.advance, task)))
        if args.ddp_processes != "0":
            task = progress.add_task("DDP (launching processes)", total=None)
            runs.append(run_ddp(config, nproc_per_node=args.ddp_processes))
            progress.update(task, total=1, completed=1, description=runs[-1].name)
            plans.append(Plan(runs[-1].name, runs[-1].name.split(", ")[1], lambda m: m))
    console.print(_table(runs, plans))
    for figure in (plot_losses(runs, args.out / "loss_curves.png"), plot_memory(runs, args.out / "memory.png")):
        console.print(f"wrote {figure}")
    return 0


def _table(runs: list[RunResult], plans: list[Plan]) -> Table:
    from rich.table import Table

    from multigpu.demo.train import max_weight_difference

    table = Table(
        title="Same seed, same global batch: one device vs DataParallel vs DDP",
        caption="max |Δw|: largest difference from the one-device run's weights after the first step and at "
        "the end. The replicas sum the same gradients over chunks instead of the whole batch, which float32 "
        "rounds differently; SGD with momentum amplifies those last bits over the run (--dtype float64: "
        "all runs agree to 1e-15). memory: peak of one step on the primary over the largest other device",
    )
    # two-line headers keep the table within a 124-column terminal (and the README)
    columns = ("run", "devices", "accuracy", "samples/s", "final\nloss", "max |Δw|\nstep 1", "max |Δw|\nend")
    for column in (*columns, "memory\nprimary/other"):
        table.add_column(column, justify="left" if column in ("run", "devices") else "right", no_wrap=True)
    for result, plan in zip(runs, plans):
        peaks = [m.peak for m in result.memory]
        ratio = f"{peaks[0] / max(peaks[1:]):.2f}" if len(peaks) > 1 else "—"
        table.add_row(
            result.name,
            plan.devices,
            f"{result.accuracy:.1%}",
            f"{result.samples_per_s:,.0f}",
            f"{result.losses[-1]:.4f}",
            "—" if result is runs[0] else f"{max_weight_difference(result, runs[0], first_step=True):.1e}",
            "—" if result is runs[0] else f"{max_weight_difference(result, runs[0]):.1e}",
            ratio,
        )
    return table
