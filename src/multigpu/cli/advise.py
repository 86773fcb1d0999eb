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
import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multigpu.cli._numbers import count, real, seconds
from multigpu.core.limits import DAY_S
from multigpu.core.lookup import lookup
from multigpu.core.script import importable_from
from multigpu.errors import ConfigError, MultigpuError
from multigpu.planning import hardware, workload
from multigpu.planning.hardware import DEFAULT_GPU_OVERLAP
from multigpu.planning.workload import OPTIMIZER_TRAFFIC, PRECISION_WEIGHT_BYTES, FsdpLayout
from multigpu.strategies.registry import strategy_names

if TYPE_CHECKING:
    import torch
    from torch import nn

    from multigpu.planning.advise import Row
    from multigpu.planning.hardware import Platform
    from multigpu.planning.workload import Workload

HELP = "predict time and memory of each strategy and device count, and recommend one"
DEFAULT_BATCH = 32
MAX_PLANNED_DEVICES = 65536  # the largest clusters today hold about this many GPUs
INPUT_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "long": "int64", "int64": "int64"}


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


def _gpu(args: argparse.Namespace) -> hardware.GpuSpec | None:
    figures = (args.gpu_tflops, args.gpu_mem_gb, args.gpu_mem_bw)
    base = hardware.gpu(args.gpu) if args.gpu else None
    if all(f is None for f in figures):
        return base
    return hardware.custom_gpu(
        fp32_tflops=args.gpu_tflops, memory_gb=args.gpu_mem_gb, memory_bandwidth_gbs=args.gpu_mem_bw, base=base
    )


def _batches(args: argparse.Namespace) -> dict[str, Any]:
    """Exactly one of per-device batch, global batch, chunk sizes (the per-device batch by default)."""
    given = [
        flag
        for flag, v in (
            ("--batch", args.batch),
            ("--global-batch", args.global_batch),
            ("--chunk-sizes", args.chunk_sizes),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise ConfigError(f"pass one of --batch, --global-batch and --chunk-sizes, not {' and '.join(given)}")
    if args.chunk_sizes is not None:
        return {"chunk_sizes": list(parse_shape(args.chunk_sizes, flag="--chunk-sizes") or ())}
    if args.global_batch is not None:
        if args.global_batch < 1:
            raise ConfigError(f"--global-batch {args.global_batch} must be >= 1")
        return {"global_batch": args.global_batch}
    batch = DEFAULT_BATCH if args.batch is None else args.batch
    if batch < 1:
        raise ConfigError(f"--batch {batch} must be >= 1 (samples per device)")
    return {"per_device_batch": batch}


def _counting_batch(batches: dict[str, Any]) -> int:
    if "chunk_sizes" in batches:
        return sum(batches["chunk_sizes"])
    if "global_batch" in batches:
        return int(batches["global_batch"])
    return int(batches["per_device_batch"])


def _measured(
    args: argparse.Namespace, gpu: hardware.GpuSpec | None, batches: dict[str, Any], counts: list[int]
) -> tuple[Workload, Platform | None]:
    """A factory model: counted on the meta device for a GPU, timed here as each strategy runs it on this CPU."""
    from multigpu.planning.counting import count_step, counted_workload

    batch = _counting_batch(batches)

    load_factory(args.model)  # a bad path is the first thing to report
    shape = parse_shape(args.input_shape)
    if shape is None:
        raise ConfigError(
            f"--model {args.model!r} is counted on sample inputs: pass --input-shape, e.g. 512 or 3,224,224"
        )
    if gpu is not None:
        model = build(args.model, meta=True)
        counted = count_step(model, sample_inputs(batch, shape, args.input_dtype, "meta"))
        w = counted_workload(counted, gpu, name=args.model, utilization=args.utilization, optimizer=args.optimizer)
        return replace(w, fsdp=_fsdp_layout(model)), None
    from multigpu.cli._advise_calibrate import cpu_plan

    model = build(args.model, meta=False)
    w, plat = cpu_plan(args, model, lambda n: sample_inputs(n, shape, args.input_dtype, "cpu"), batches, counts)
    if args.busbw is not None:
        if args.busbw <= 0:
            raise ConfigError(f"--busbw {args.busbw} must be > 0 GB/s (a measured all-reduce bus bandwidth)")
        plat = replace(plat, link=hardware.measured_link(args.busbw * 1e9, name="gloo (measured)"))
    return replace(w, fsdp=_fsdp_layout(model)), plat


def _fsdp_layout(model: Any) -> FsdpLayout:
    """The groups the fsdp strategy makes of ``model`` by default (the Session's own rule)."""
    from multigpu.planning.counting import count_fsdp_groups
    from multigpu.strategies.fsdp import FSDPOptions, select_blocks

    return FsdpLayout(groups=count_fsdp_groups(model, select_blocks(model, FSDPOptions())))


def _overrides(w: Workload, args: argparse.Namespace) -> Workload:
    changes: dict[str, Any] = {
        "precision": args.precision,
        "fsdp": replace(w.fsdp, reshard_after_forward=not args.fsdp_no_reshard),
    }
    if args.params is not None:
        changes["params"] = args.params
        changes["fsdp"] = changes["fsdp"].scaled(args.params)
    if args.compute_ms is not None:
        changes["compute_s_per_sample"] = args.compute_ms / 1e3
    if args.activation_mb is not None:
        changes["activation_bytes_per_sample"] = args.activation_mb * 1e6
    if args.output_mb is not None:
        changes["output_bytes_per_sample"] = args.output_mb * 1e6
    return replace(w, **changes)


def _gpu_platform(args: argparse.Namespace, gpu: hardware.GpuSpec) -> Platform:
    if args.busbw is None and not args.link:
        raise ConfigError(f"--gpu {gpu.name} needs --link (one of {', '.join(hardware.LINKS)}) or a measured --busbw")
    device_link = hardware.measured_link(args.busbw * 1e9) if args.busbw is not None else hardware.link(args.link)
    network = hardware.link(args.network) if args.network else None
    return hardware.gpu_platform(
        gpu,
        device_link,
        network=network,
        devices_per_node=args.devices_per_node,
        overlap=args.overlap,
        pinned=args.pin_memory,
    )


def _plan(args: argparse.Namespace) -> tuple[Workload, Platform, list[Row], dict[str, Any]]:
    from multigpu.planning.advise import evaluate

    counts = list(parse_shape(args.devices or "1,2,4,8", flag="--devices") or ())
    if max(counts) > MAX_PLANNED_DEVICES:  # --devices 100000000 planned for minutes
        raise ConfigError(
            f"--devices {args.devices}: plan at most {MAX_PLANNED_DEVICES} devices, e.g. --devices 1,8,64,512"
        )
    batches = _batches(args)
    gpu = _gpu(args)
    plat: Platform | None = None
    if args.model.lower() in workload.PRESETS:
        if gpu is None:
            raise ConfigError(
                f"preset {args.model!r} needs --gpu (one of {', '.join(hardware.GPUS)}) or --gpu-tflops ..."
            )
        w = workload.from_preset(
            args.model,
            gpu,
            utilization=args.utilization,
            optimizer=args.optimizer,
            input_shape=parse_shape(args.input_shape),
        )
    else:
        w, plat = _measured(args, gpu, batches, counts)
    w = _overrides(w, args)
    if gpu is not None:
        plat = _gpu_platform(args, gpu)
    if plat is None:
        raise ConfigError(
            "no platform: pass --gpu (or --gpu-tflops ...) for a GPU plan, or a factory model for this CPU"
        )
    return w, plat, evaluate(w, plat, counts, **batches), batches


def _inputs(w: Workload, plat: Platform, rows: list[Row], batches: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": w.name,
        "params": w.params,
        "compute_ms_per_sample": w.compute_s_per_sample * 1e3,
        "activation_bytes_per_sample": w.activation_bytes_per_sample,
        "output_bytes_per_sample": w.output_bytes_per_sample,
        "input_bytes_per_sample": w.input_bytes_per_sample,
        "optimizer": w.optimizer,
        "precision": w.precision,
        "fsdp_groups": list(w.fsdp.resolved(w.params)),
        "fsdp_reshard_after_forward": w.fsdp.reshard_after_forward,
        "platform": plat.name,
        "memory_bytes_per_device": plat.memory_bytes,
        "devices": sorted({r.devices for r in rows}),
        **batches,
    }


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
        w, plat, rows, batches = _plan(args)
    except (MultigpuError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        return 2
    rec = recommend(rows, plat.memory_bytes)
    plan = to_json(rows, rec, _inputs(w, plat, rows, batches))
    written = write_result(
        args, plan, lambda out: plot_throughput(rows, out / "advise.png", f"{w.name} on {plat.name}")
    )
    if written is not None:
        print_plan(console, w, plat, rows, rec)
        console.print(written, soft_wrap=True)
    return 0


def write_result(args: argparse.Namespace, result: dict[str, Any], draw: Callable[[Path], Path]) -> str | None:
    """``advise.json`` and the figure ``draw`` makes (unless ``--no-figure``) in ``--out``; the JSON printed
    under ``--json`` (then None), else the line that says what was written, for after the table."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "advise.json").write_text(json.dumps(result, indent=2) + "\n")
    figure = None if args.no_figure else draw(out)
    if args.json:
        print(json.dumps(result, indent=2))
        return None
    return f"written: {out / 'advise.json'}" + (f", {figure}" if figure else "")


def load_factory(path: str) -> Callable[[], object]:
    """The callable at ``package.module:attribute``, importable from the current folder too (console
    scripts do not put it on the path), so ``--model mynet:build`` finds ``./mynet.py``.

    Raises:
        ConfigError: no ``:``, a module or attribute that does not import (the message says which).
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(
            f"--model {path!r} is neither a preset ({', '.join(workload.PRESETS)}) nor 'package.module:factory'"
        )
    try:
        with importable_from():  # console scripts do not put the current folder on the path
            factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model {path!r}: cannot import {attr!r} from {module_name!r} ({exc})") from exc
    if not callable(factory):
        raise ConfigError(f"--model {path!r} names a {type(factory).__name__}, not a function that builds a model")
    return factory  # type: ignore[no-any-return]


def build(path: str, *, meta: bool) -> nn.Module:
    """Call the factory at ``path`` (on the meta device when ``meta``) and check it built a module.

    For a GPU plan the factory runs under ``torch.device("meta")``: every tensor it creates has a
    shape and no data, so a billion-parameter model is built and counted in seconds without memory.
    For a plan on this CPU the model is built for real and timed (:mod:`multigpu.planning.cpu_plan`).
    """
    import torch
    from torch import nn

    factory = load_factory(path)
    try:
        if meta:
            with torch.device("meta"):
                made = factory()
        else:
            made = factory()
    except Exception as exc:  # the user's code: any failure becomes one clear line
        where = (
            " on the meta device (a GPU plan builds it without data; plan on this CPU to build it for real)"
            if meta
            else ""
        )
        raise ConfigError(f"--model {path!r}: the factory raised {type(exc).__name__}: {exc}{where}") from exc
    if not isinstance(made, nn.Module):
        raise ConfigError(f"--model {path!r} returned {type(made).__name__}, not an nn.Module")
    return made


def parse_shape(text: str | None, *, flag: str = "--input-shape") -> tuple[int, ...] | None:
    """``"3,224,224"`` -> ``(3, 224, 224)``; None stays None (also for device counts and chunk sizes).

    Raises:
        ConfigError: a part that is not a positive integer.
    """
    if text is None:
        return None
    try:
        shape = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise ConfigError(f"{flag} {text!r} must be positive integers separated by commas, e.g. 512 or 3,224,224")
    return shape


def sample_inputs(batch: int, shape: Sequence[int], dtype: str, device: torch.device | str) -> torch.Tensor:
    """A batch of ``batch`` samples of ``shape``: random floats, or token ids 0 (valid for any vocabulary).

    Raises:
        ConfigError: an unknown dtype.
    """
    import torch

    message = "--input-dtype {value!r} is not one of {choices}; e.g. --input-dtype long for token ids"
    kind = getattr(torch, lookup(INPUT_DTYPES, dtype, message))
    if kind.is_floating_point:
        return torch.randn(batch, *shape, dtype=kind, device=device)
    return torch.zeros(batch, *shape, dtype=kind, device=device)
