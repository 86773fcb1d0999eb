"""Save + load a ~100 MB model: atomic multigpu.save/load versus plain torch.save/torch.load.

    .venv/bin/python benchmarks/checkpoint_io.py              # 7 repeats, files in a temp folder
    .venv/bin/python benchmarks/checkpoint_io.py --repeats 11 --dir /data/tmp

Every repeat times each method once, in rotating order, on the same disk; the table shows the
median of the repeats and each method's ratio to plain torch.save + torch.load (the target for
multigpu's default, safetensors, is at most 1.10). multigpu's saves are atomic, durable
(temporary file, fsync, rename, fsync of the folder) and checksummed (a CRC-32 per tensor,
checked on load); plain torch.save is none of these, so the ratio is the price of never
finding a half-written checkpoint and never loading a damaged one. Timings on a shared machine are
noisy: compare ratios, and rerun with more repeats when they are close to the target.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch import nn

import multigpu.checkpoint as ckpt

TARGET = 1.10


def build_model(megabytes: float) -> nn.Module:
    width = 2560
    layers = max(1, round(megabytes * 2**20 / (4 * (width * width + width))))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def plain_save(model: nn.Module, path: Path) -> None:
    torch.save(model.state_dict(), path)


def plain_load(model: nn.Module, path: Path) -> None:
    model.load_state_dict(torch.load(path, weights_only=True))


def methods() -> dict[str, tuple[str, Callable[[nn.Module, Path], object], Callable[[nn.Module, Path], object]]]:
    return {
        "plain torch.save/load": ("w.pt", plain_save, plain_load),
        "multigpu, safetensors": ("w.safetensors", ckpt.save, ckpt.load),
        "multigpu, torch format": ("w2.pt", ckpt.save, ckpt.load),
    }


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def measure(model: nn.Module, folder: Path, repeats: int) -> dict[str, dict[str, list[float]]]:
    chosen = methods()
    results: dict[str, dict[str, list[float]]] = {name: {"save": [], "load": []} for name in chosen}
    names = list(chosen)
    with Progress(transient=True) as progress:
        task = progress.add_task("saving and loading", total=repeats * len(names))
        for repeat in range(repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:  # rotate the order
                filename, save, load = chosen[name]
                path = folder / filename
                results[name]["save"].append(timed(lambda: save(model, path)))  # noqa: B023 (called at once, inside this iteration)
                results[name]["load"].append(timed(lambda: load(model, path)))  # noqa: B023 (called at once, inside this iteration)
                path.unlink()
                progress.advance(task)
    return results


def report(results: dict[str, dict[str, list[float]]], megabytes: float, repeats: int) -> bool:
    baseline_name = next(iter(results))
    medians = {
        name: {kind: statistics.median(values) for kind, values in times.items()} for name, times in results.items()
    }
    base = medians[baseline_name]
    table = Table(title=f"save + load of a {megabytes:.0f} MB model, median of {repeats} repeats")
    table.caption = "ratio: to plain torch.save/load; multigpu's writes are atomic and fsynced, plain ones are not"
    for column in ("method", "save ms", "load ms", "total ms", "save x", "load x", "total x"):
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=True)
    for name, m in medians.items():
        total, base_total = m["save"] + m["load"], base["save"] + base["load"]
        table.add_row(
            name,
            f"{m['save']:.0f}",
            f"{m['load']:.0f}",
            f"{total:.0f}",
            f"{m['save'] / base['save']:.2f}",
            f"{m['load'] / base['load']:.2f}",
            f"{total / base_total:.2f}",
        )
    console = Console(width=max(100, Console().width))
    console.print(table)
    default = medians["multigpu, safetensors"]
    ratio = (default["save"] + default["load"]) / (base["save"] + base["load"])
    verdict = "[green]meets[/]" if ratio <= TARGET else "[red]misses[/]"
    console.print(f"default (safetensors) save+load ratio {ratio:.2f}: {verdict} the target <= {TARGET:.2f}")
    return ratio <= TARGET


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--megabytes", type=float, default=100.0, help="model size in MB of float32 weights (default 100)"
    )
    parser.add_argument("--repeats", type=int, default=7, help="repeats per method; the median is reported (default 7)")
    parser.add_argument("--dir", type=Path, default=None, help="folder for the files (default: a new temp folder)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(args.megabytes)
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    folder = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        results = measure(model, folder, args.repeats)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report(results, megabytes, args.repeats)


if __name__ == "__main__":
    main()
