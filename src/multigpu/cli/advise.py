"""Predict step time, throughput and memory of each strategy at each device count, and recommend one.

Built-in models (sizes and FLOPs from their papers; compute = FLOPs at 30% of the GPU's fp32 peak):

    multigpu advise --model gpt2-124m --gpu titan-rtx --link nvlink-titan-rtx --devices 1,2 --batch 4
    multigpu advise --model resnet50 --gpu v100-32gb --link nvlink-v100 --devices 1,2,4,8 --batch 32

Your own model (a factory ``package.module:function`` returning an nn.Module), measured here:

    multigpu advise --model mypkg.nets:build --input-shape 512 --devices 1,2          # on this CPU
    multigpu advise --model mypkg.nets:build --input-shape 3,224,224 --gpu a100-80gb --link nvlink-a100

With --gpu, a measured model's sizes carry over and its compute comes from its counted FLOPs
(torch's FlopCounterMode) at --utilization of the GPU's fp32 peak; --compute-ms replaces that.

A bandwidth measured by ``multigpu bandwidth`` replaces the link preset: ``--busbw 180`` (GB/s).
Equations, assumptions and sources: docs/planning.md.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import replace
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from multigpu.errors import ConfigError, MultigpuError
from multigpu.planning import hardware, models
from multigpu.planning.advise import Row, evaluate, plot_throughput, recommend
from multigpu.planning.measure import count_flops, measure_cpu_platform, measure_workload
from multigpu.planning.platform import DEFAULT_GPU_OVERLAP, Platform, gpu_platform
from multigpu.planning.workload import OPTIMIZER_TRAFFIC, PRECISION_WEIGHT_BYTES, Workload

HELP = "predict time and memory of each strategy and device count, and recommend one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help=f"a preset ({', '.join(models.PRESETS)}) or 'package.module:factory'"
    )
    parser.add_argument("--input-shape", help="per-sample input shape for a factory model, e.g. 512 or 3,224,224")
    parser.add_argument("--gpu", help=f"GPU preset: {', '.join(hardware.GPUS)} (default: plan on this CPU)")
    parser.add_argument("--link", help=f"link between devices: {', '.join(hardware.LINKS)}")
    parser.add_argument(
        "--busbw", type=float, help="measured all-reduce bus bandwidth in GB/s (multigpu bandwidth); replaces --link"
    )
    parser.add_argument(
        "--devices", default="1,2,4,8", help="device counts to compare, comma-separated (default 1,2,4,8)"
    )
    parser.add_argument("--batch", type=int, default=32, help="samples per device per step (default 32)")
    parser.add_argument(
        "--optimizer", default="adam", choices=sorted(OPTIMIZER_TRAFFIC), help="optimizer (memory and step time)"
    )
    parser.add_argument(
        "--precision", default="fp32", choices=sorted(PRECISION_WEIGHT_BYTES), help="weights/gradients precision"
    )
    parser.add_argument("--params", type=int, help="override: trainable parameters")
    parser.add_argument("--compute-ms", type=float, help="override: forward+backward ms per sample on one device")
    parser.add_argument("--activation-mb", type=float, help="override: MB saved for backward per sample")
    parser.add_argument(
        "--output-mb", type=float, help="override: MB of outputs per sample (DataParallel gathers them)"
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=models.FP32_UTILIZATION,
        help="share of fp32 peak used to turn FLOPs into time",
    )
    parser.add_argument(
        "--overlap",
        type=float,
        default=DEFAULT_GPU_OVERLAP,
        help="share of hideable all-reduce hidden behind backward (GPU)",
    )
    parser.add_argument(
        "--devices-per-node", type=int, help="devices per machine; more devices span nodes over --network"
    )
    parser.add_argument("--network", help="link between nodes, e.g. ib-hdr")
    parser.add_argument("--figure", default="advise.png", help="PNG of throughput vs devices (default advise.png)")
    parser.add_argument("--no-figure", action="store_true", help="do not write the PNG")


def _load_factory(path: str) -> torch.nn.Module:
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ConfigError(
            f"--model {path!r} is neither a preset nor 'package.module:factory'; presets: {', '.join(models.PRESETS)}"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model {path!r}: cannot import {attr!r} from {module_name!r} ({exc})") from exc
    made = factory()
    if not isinstance(made, torch.nn.Module):
        raise ConfigError(f"--model {path!r} returned {type(made).__name__}, not an nn.Module")
    return made


def _measured(args: argparse.Namespace, gpu: hardware.GpuSpec | None) -> tuple[Workload, torch.nn.Module, torch.Tensor]:
    model = _load_factory(args.model)
    if not args.input_shape:
        raise ConfigError(
            f"--model {args.model!r} is measured on sample inputs: pass --input-shape, e.g. 512 or 3,224,224"
        )
    shape = tuple(int(s) for s in args.input_shape.split(",") if s.strip())
    inputs = torch.randn(args.batch, *shape)
    w = measure_workload(model, inputs, optimizer=args.optimizer, name=args.model)
    if gpu is not None:  # CPU time does not carry over to a GPU; FLOPs do
        flops = count_flops(model, inputs) / args.batch
        w = replace(w, compute_s_per_sample=flops / (gpu.fp32_flops * args.utilization), optimizer_s=None)
    return w, model, inputs


def _overrides(w: Workload, args: argparse.Namespace) -> Workload:
    changes: dict[str, Any] = {"precision": args.precision}
    if args.params is not None:
        changes["params"] = args.params
    if args.compute_ms is not None:
        changes["compute_s_per_sample"] = args.compute_ms / 1e3
    if args.activation_mb is not None:
        changes["activation_bytes_per_sample"] = args.activation_mb * 1e6
    if args.output_mb is not None:
        changes["output_bytes_per_sample"] = args.output_mb * 1e6
    return replace(w, **changes)


def _platform(
    args: argparse.Namespace, gpu: hardware.GpuSpec | None, model: torch.nn.Module | None, inputs: torch.Tensor | None
) -> Platform:
    busbw = args.busbw * 1e9 if args.busbw else None
    if gpu is None:
        if model is None or inputs is None:
            raise ConfigError(
                f"--model {args.model} is a GPU preset: pass --gpu (one of {', '.join(hardware.GPUS)}) and --link"
            )
        return measure_cpu_platform(model, inputs[: max(1, args.batch // 2)], busbw=busbw)
    if busbw is None and not args.link:
        raise ConfigError(f"--gpu {args.gpu} needs --link (one of {', '.join(hardware.LINKS)}) or a measured --busbw")
    device_link = hardware.measured_link(busbw) if busbw else hardware.link(args.link)
    network = hardware.link(args.network) if args.network else None
    return gpu_platform(gpu, device_link, network=network, devices_per_node=args.devices_per_node, overlap=args.overlap)


_SHORT = {"single": "single", "dataparallel": "DP", "dataparallel-balanced": "DP-bal", "ddp": "DDP"}


def _chunks(chunks: tuple[int, ...]) -> str:
    if len(set(chunks)) == 1:
        return str(chunks[0])
    others = chunks[1:]
    rest = str(others[0]) if len(set(others)) == 1 else f"{min(others)}-{max(others)}"
    return f"{chunks[0]} | {rest}"


def _memory(memory: list[float]) -> str:
    if len(memory) == 1 or len({round(m / 2**27) for m in memory}) == 1:
        return f"{memory[0] / 2**30:.2f}"
    return f"{memory[0] / 2**30:.2f} | {max(memory[1:]) / 2**30:.2f}"


def _table(rows: list[Row], plat: Platform) -> Table:
    limit = f"/{plat.memory_bytes / 2**30:.0f}" if plat.memory_bytes else ""
    table = Table(title=f"Predicted step on {plat.name} (primary | others)", title_style="bold")
    for col in (
        "strategy",
        "N",
        "batch/dev",
        "step ms",
        "samples/s",
        "scaling",
        "overhead ms",
        f"peak GiB{limit}",
        "fits",
    ):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            _SHORT[r.strategy],
            str(r.devices),
            _chunks(r.step.chunks),
            f"{r.step.total_s * 1e3:.1f}",
            f"{r.step.throughput:,.0f}",
            f"{r.efficiency:.0%}",
            f"{(r.step.total_s - r.step.parts['compute']) * 1e3:.1f}",
            _memory(r.memory),
            "yes" if r.fits else "[red]no[/red]",
        )
    return table


def _breakdown(row: Row) -> str:
    """Where one step's time goes, largest first (ms)."""
    parts = sorted(((v, k) for k, v in row.step.parts.items() if v * 1e3 >= 0.05), reverse=True)
    return f"  {_SHORT[row.strategy]} x{row.devices} step (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for v, k in parts)


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        counts = [int(s) for s in args.devices.split(",") if s.strip()]
        gpu = hardware.gpu(args.gpu) if args.gpu else None
        model = inputs = None
        if args.model.lower() in models.PRESETS:
            if gpu is None:
                raise ConfigError(f"preset {args.model!r} needs --gpu (one of {', '.join(hardware.GPUS)})")
            w = models.workload(args.model, gpu, utilization=args.utilization, optimizer=args.optimizer)
        else:
            w, model, inputs = _measured(args, gpu)
        w = _overrides(w, args)
        plat = _platform(args, gpu, model, inputs)
        rows = evaluate(w, plat, counts, args.batch)
    except (MultigpuError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    console.print(_table(rows, plat))
    console.print(
        f"inputs: {w.name}, {w.params / 1e6:.1f}M params, {w.compute_s_per_sample * 1e3:.2f} ms/sample compute, "
        f"{w.activation_bytes_per_sample / 1e6:.0f} MB activations and {w.output_bytes_per_sample / 1e6:.1f} MB outputs per sample, "
        f"{args.batch} samples per device, {w.optimizer} {w.precision}",
        soft_wrap=True,
    )
    rec = recommend(rows, plat.memory_bytes)
    console.print(f"[bold]{rec.sentence}[/bold]", soft_wrap=True)
    for r in rows:
        if r.devices == rec.devices and r.strategy in ("dataparallel", "ddp"):
            console.print(_breakdown(r), soft_wrap=True)
    if not args.no_figure:
        path = plot_throughput(rows, args.figure, f"{w.name} on {plat.name}, batch {args.batch} per device")
        console.print(f"figure: {path}")
    return 0
