"""Measure the bandwidth this machine really gives, as nccl-tests would report it.

    multigpu bandwidth                          # 1 KiB .. 256 MiB, copies, DP pattern, all-reduce
    multigpu bandwidth --max-size 16MiB --factor 4 --out bw
    multigpu bandwidth --devices cuda:0,1 --world-size 2 --backend nccl

Probes, per message size: copies (host->host; with CUDA also host<->device and device->device),
the DataParallel pattern on --devices (broadcast from and reduce-add onto the primary, with the
engine's own primitives) and an all-reduce across --world-size local processes (gloo on CPU,
nccl on GPUs). algbw = bytes / time; busbw = algbw * 2(n-1)/n for all-reduce, * 1 otherwise.
Writes a table to the terminal, and bandwidth.png and bandwidth.json to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from multigpu.cli._numbers import count, seconds
from multigpu.core.limits import DAY_S, process_bound
from multigpu.errors import ConfigError, MultigpuError

HELP = "measure copy, broadcast/reduce and all-reduce bandwidth against message size (nccl-tests algbw/busbw)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-size", default="1KiB", help="smallest message (default 1KiB; units B, KiB, MiB, GiB)")
    parser.add_argument(
        "--max-size", default="256MiB", help="largest message (default 256MiB; lower it on a busy machine)"
    )
    parser.add_argument(
        "--factor",
        type=count(2, None, "a size factor"),
        default=2,
        help="each size is this many times the last (default 2)",
    )
    parser.add_argument(
        "--devices", default=None, help="replicas for the broadcast/reduce pattern (default: every GPU, else cpu:2)"
    )
    parser.add_argument(
        "--world-size",
        type=count(2, process_bound(), "a process count (4 per CPU core at most)"),
        default=2,
        help="processes in the all-reduce (default 2)",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="all-reduce backend (default: nccl on GPUs, else gloo)",
    )
    parser.add_argument("--no-all-reduce", action="store_true", help="skip the multi-process all-reduce probe")
    parser.add_argument(
        "--repeats",
        type=count(1, 1000, "a loop count"),
        default=5,
        help="timed loops per point; the fastest is kept (default 5)",
    )
    parser.add_argument(
        "--timeout", type=seconds(DAY_S), default=600.0, help="seconds before the all-reduce processes are stopped"
    )
    parser.add_argument("--out", default="bandwidth-out", help="folder for bandwidth.png and bandwidth.json")


def run(args: argparse.Namespace) -> int:
    # torch and the probes are imported when the command runs: building the parser stays cheap
    from rich.console import Console
    from rich.progress import Progress

    from multigpu.devices import parse_devices, replica_device_type
    from multigpu.launcher.allreduce_probe import default_backend, probe_all_reduce
    from multigpu.profiling.bandwidth import message_sizes, parse_size, probe_local
    from multigpu.report.figures import bandwidth_figure
    from multigpu.report.folder import write_bandwidth_json
    from multigpu.report.tables import bandwidth_table

    console = Console()
    try:
        sizes = message_sizes(parse_size(args.min_size), parse_size(args.max_size), args.factor)
        devices = parse_devices(args.devices or replica_device_type().default_devices())
        backend = args.backend or default_backend()
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("local probes", total=len(sizes) + (0 if args.no_all_reduce else 1))
            points, notes = probe_local(sizes, devices, repeats=args.repeats, progress=lambda _: bar.advance(task))
            if not args.no_all_reduce:
                bar.update(task, description=f"all-reduce over {args.world_size} {backend} processes")
                try:
                    points += probe_all_reduce(
                        sizes, world_size=args.world_size, backend=backend, timeout_s=args.timeout, repeats=args.repeats
                    )
                except ConfigError as exc:  # e.g. one GPU: the local probes still stand on their own
                    notes.append(f"all-reduce not probed: {exc}")
                bar.advance(task)
    except MultigpuError as exc:
        print(f"error: {exc}", file=sys.stderr)  # plain: an error message must not wrap
        return 2
    console.print(bandwidth_table(points))
    for note in notes:
        console.print(f"[dim]note: {note}[/dim]", soft_wrap=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = [bandwidth_figure(points, out / "bandwidth.png"), write_bandwidth_json(points, out / "bandwidth.json")]
    console.print("wrote " + ", ".join(str(f) for f in files))
    return 0
