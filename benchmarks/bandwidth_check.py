"""Does ``multigpu bandwidth``'s copy figure agree with a plain torch copy loop? (target: within 10%)

    .venv/bin/python benchmarks/bandwidth_check.py
    .venv/bin/python benchmarks/bandwidth_check.py --sizes 64KiB 1MiB 16MiB 64MiB --rounds 7

For each size, in the same run and alternating round by round: the probe behind the command
(:func:`multigpu.profiling.bandwidth.probe_copy`) and a plain loop written here from scratch
(``dst.copy_(src)`` N times between two ``perf_counter`` reads, N fixed per size so a loop
copies 64 MiB; five loops per round). Each side reports its best loop over all rounds (the
probe's own figure is its fastest loop, as STREAM reports; the plain side is held to the same
rule), and the table gives both in GB/s (1e9 B/s) and their ratio.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from multigpu.profiling.bandwidth import parse_size, probe_copy
from multigpu.report.tables import format_bytes


def plain_copy_gbps(nbytes: int, loops: int, timings: int = 5) -> list[float]:
    """GB/s of ``timings`` timed loops of ``loops`` copies each."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out = []
    for _ in range(timings):
        start = time.perf_counter()
        for _ in range(loops):
            dst.copy_(src)
        out.append(nbytes * loops / (time.perf_counter() - start) / 1e9)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["64KiB", "1MiB", "16MiB", "64MiB"])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads for both sides (default: torch's)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    title = f"cpu->cpu copy, {torch.get_num_threads()} torch thread(s): probe vs plain loop (best of {args.rounds} alternating rounds)"
    table = Table(title=title)
    for column in ("size", "probe GB/s", "plain loop GB/s", "probe / plain", "within 10%"):
        table.add_column(column, justify="right")
    for text in args.sizes:
        nbytes = parse_size(text)
        loops = max(1, min(2000, (64 * 2**20) // nbytes))  # ~64 MiB copied per timed loop
        probe, plain = [], []
        for _ in range(args.rounds):
            probe.append(probe_copy(cpu, cpu, nbytes, repeats=5).algbw)
            plain += plain_copy_gbps(nbytes, loops)
        ratio = max(probe) / max(plain)
        ok = abs(ratio - 1) <= 0.10
        table.add_row(
            format_bytes(nbytes),
            f"{max(probe):.2f}",
            f"{max(plain):.2f}",
            f"{ratio:.3f}",
            "[green]yes[/green]" if ok else "[red]no[/red]",
        )
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
