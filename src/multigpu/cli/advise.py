"""Predict step time, throughput and memory of each strategy at each device count, and recommend one.

Built-in models (sizes, FLOPs and host counts from their papers and equivalent module trees):

    multigpu advise --model resnet50 --gpu a100-80gb --link nvlink-a100 --devices 1,2,4,8 --batch 32
    multigpu advise --model resnet50 --input-shape 3,32,32 --gpu a100-80gb --link nvlink-a100 --global-batch 1024

Your own model (a factory ``package.module:function`` returning an nn.Module, found from the
current folder too): counted on the meta device for a GPU plan (nothing runs, any size), or
measured here at a small batch for a plan on this CPU:

    multigpu advise --model mynet:build --input-shape 3,224,224 --gpu h100 --link nvlink-h100
    multigpu advise --model mynet:build --input-shape 128 --input-dtype long --devices 1,2   # this CPU

Rows for every strategy: single, dp, dp-balanced, ddp and fsdp (its groups: the Session's default
rule, counted on the model; --fsdp-no-reshard plans FSDPOptions(reshard_after_forward=False)).
Any GPU: a preset (--gpu), or its figures (--gpu-tflops, --gpu-mem-gb, --gpu-mem-bw). A bandwidth
measured by ``multigpu bandwidth`` replaces the link preset: ``--busbw 180`` (GB/s). ``--json``
prints the plan for programs; the figure and advise.json go to --out. Equations, assumptions and
sources: docs/planning.md.

Checked on this machine: ``--measure`` runs a few timed steps of every strategy that fits the devices
present, each in its own process, within ``--budget`` seconds, and prints measured beside predicted:

    multigpu advise --measure --model mynet:build --input-shape 3,32,32 --budget 60
    multigpu advise --measure --script train.py --script-args "--epochs 1"
"""

from __future__ import annotations

import argparse

from multigpu.cli._advise_plan import DEFAULT_BATCH, MAX_PLANNED_DEVICES, build_plan, plan_inputs, write_result
from multigpu.cli._numbers import count, real, seconds
from multigpu.core.limits import DAY_S
from multigpu.errors import ConfigError, MultigpuError
from multigpu.planning import hardware, workload
from multigpu.planning.hardware import DEFAULT_GPU_OVERLAP
from multigpu.planning.workload import OPTIMIZER_TRAFFIC, PRECISION_WEIGHT_BYTES
from multigpu.strategies.registry import strategy_names

HELP = "predict time and memory of each strategy and device count, and recommend one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        help=f"a preset ({', '.join(workload.PRESETS)}) or 'package.module:factory' (required unless --script)",
    )
    model.add_argument("--input-shape", help="per-sample input shape, e.g. 512 or 3,224,224 (presets: rescales them)")
    model.add_argument(
        "--input-dtype", default="float32", help="input dtype for a factory model: float32 or long (token ids)"
    )
    model.add_argument(
        "--optimizer", default="adam", choices=sorted(OPTIMIZER_TRAFFIC), help="optimizer (memory and step time)"
    )
    model.add_argument(
        "--precision", default="fp32", choices=sorted(PRECISION_WEIGHT_BYTES), help="weights/gradients precision"
    )
    model.add_argument("--params", type=count(1, None, "a parameter count"), help="override: trainable parameters")
    model.add_argument(
        "--compute-ms",
        type=real(0, None, "milliseconds"),
        help="override: forward+backward device ms per sample on one device",
    )
    model.add_argument(
        "--activation-mb",
        type=real(0, None, "megabytes", low_open=False),
        help="override: MB saved for backward per sample",
    )
    model.add_argument(
        "--output-mb",
        type=real(0, None, "megabytes", low_open=False),
        help="override: MB of outputs per sample (DataParallel gathers them)",
    )
    model.add_argument(
        "--utilization",
        type=real(0, 1, "a share of the peak"),
        default=workload.FP32_UTILIZATION,
        help="share of fp32 peak reached (FLOPs -> time)",
    )
    model.add_argument(
        "--fsdp-no-reshard",
        action="store_true",
        help="fsdp rows with FSDPOptions(reshard_after_forward=False): blocks stay gathered until backward",
    )

    hw = parser.add_argument_group("hardware")
    hw.add_argument("--gpu", help=f"GPU preset: {', '.join(hardware.GPUS)} (default: plan on this CPU)")
    hw.add_argument(
        "--gpu-tflops", type=real(0, None, "TFLOPS"), help="any other GPU: dense fp32 TFLOPS (with --gpu: overrides)"
    )
    hw.add_argument("--gpu-mem-gb", type=real(0, None, "gigabytes"), help="any other GPU: memory in GB")
    hw.add_argument("--gpu-mem-bw", type=real(0, None, "GB/s"), help="any other GPU: memory bandwidth in GB/s")
    hw.add_argument("--link", help=f"link between devices: {', '.join(hardware.LINKS)}")
    hw.add_argument(
        "--busbw",
        type=real(0, None, "GB/s"),
        help="measured all-reduce bus bandwidth in GB/s (multigpu bandwidth); replaces --link",
    )
    hw.add_argument(
        "--devices-per-node",
        type=count(1, MAX_PLANNED_DEVICES, "a device count"),
        help="devices per machine; more devices span nodes over --network",
    )
    hw.add_argument("--network", help="link between nodes, e.g. ib-hdr")
    hw.add_argument("--pin-memory", action="store_true", help="inputs come pinned (DataLoader(pin_memory=True))")
    hw.add_argument(
        "--overlap",
        type=real(0, 1, "a share", low_open=False),
        default=DEFAULT_GPU_OVERLAP,
        help="share of hideable all-reduce hidden (GPU)",
    )

    plan = parser.add_argument_group("plan")
    plan.add_argument(
        "--devices", help="device counts to compare, comma-separated (default 1,2,4,8; --measure: 1 and all present)"
    )
    plan.add_argument(
        "--batch", type=count(1, None, "a batch size"), help=f"samples per device per step (default {DEFAULT_BATCH})"
    )
    plan.add_argument(
        "--global-batch",
        type=count(1, None, "a batch size"),
        help="samples per step, split over the devices (instead of --batch)",
    )
    plan.add_argument("--chunk-sizes", help="one DataParallel split to plan, e.g. 4,19,19,18 (instead of --batch)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (inputs, rows, recommendation)")
    plan.add_argument("--out", default="advise-out", help="folder for advise.png and advise.json (default advise-out)")
    plan.add_argument("--no-figure", action="store_true", help="do not write advise.png")

    measured = parser.add_argument_group("measure (check the plan on this machine)")
    measured.add_argument(
        "--measure",
        action="store_true",
        help="also run a few timed steps of every strategy that fits the devices present, each in its own process",
    )
    measured.add_argument(
        "--budget", type=seconds(DAY_S), default=60.0, help="seconds for all measured runs together (default 60)"
    )
    measured.add_argument(
        "--strategies", help=f"strategies to measure, comma-separated (default {','.join(strategy_names())})"
    )
    measured.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure this machine's constants again (CPU plans; else they are read from the cache)",
    )
    measured.add_argument("--script", help="measure this Session training script instead of a factory model")
    measured.add_argument("--script-args", help='arguments for --script, in one string: "--epochs 1 --lr 0.1"')


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from multigpu.planning.advise import plot_throughput, print_plan, recommend, to_json

    console = Console()
    if args.measure:
        from multigpu.cli._advise_measure import run_measure

        return run_measure(args, console)
    try:
        if args.model is None:
            raise ConfigError("pass --model (a preset or package.module:factory); --script needs --measure")
        w, plat, rows, batches = build_plan(args)
    except (MultigpuError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        return 2
    rec = recommend(rows, plat.memory_bytes)
    result = to_json(rows, rec, plan_inputs(w, plat, rows, batches))
    written = write_result(
        args, result, lambda out: plot_throughput(rows, out / "advise.png", f"{w.name} on {plat.name}")
    )
    if written is not None:
        print_plan(console, w, plat, rows, rec)
        console.print(written, soft_wrap=True)
    return 0
