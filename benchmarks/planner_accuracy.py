"""Planner accuracy on this CPU: ``multigpu advise``'s predicted step time against ``advise --measure``'s.

    python benchmarks/planner_accuracy.py [--cases mlp:128,mlp:512,cnn-bn:32,cnn-bn:128] [--budget 40]
                                          [--pairs 3] [--tolerance 0.3] [--with-feedback] [--json OUT]

One run: the machine's constants are measured once (:mod:`multigpu.launcher.machine_probe`, into a
fresh cache folder), then for each case (a model and a global batch) ``multigpu advise --measure
--devices 1,2`` predicts every strategy (single, dp on ``cpu:2``, 2-process ddp and fsdp) from
that calibration and then times each in its own processes. By default every case starts from the
same constants as measured (no case's feedback reaches another's prediction: the accuracy of the
calibration alone); ``--with-feedback`` lets each case's measurement feed the constants the next
case predicts from (the user's path).

Each case runs ``--pairs`` times (3), pair by pair over the cases: every run calibrates the model
and measures it anew, so each is one (prediction, measurement) pair. On the 2 development cores one
pair moves by 10-20% from the next, on both sides: the calibration (a contention or a speed-up read
in 15 rounds) and the measurement (a 2-process run's steps are 40-70 ms from one launch to the next
for the same fsdp case, each launch's own 25th percentile steady). The table shows per strategy the
medians of the pairs' predictions, measurements and errors (predicted / measured - 1), every pair's
error beside them, the load average over the case's runs and the fewest timed steps behind a
measurement (``--measure`` keeps the 25th percentile of up to 40); it exits 1 when a median error is
beyond ``--tolerance`` or a run failed. ``--pairs 1`` is the single-pair run of earlier revisions.
Not niced: it is a timing benchmark; the load average before and after is printed (rerun when
``uptime`` shows other work).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("single", "dp", "ddp", "fsdp")
DEFAULT_CASES = "mlp:128,mlp:512,cnn-bn:32,cnn-bn:128"


def _conv_bn(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


def mlp() -> nn.Module:
    """512 -> 1024 -> 1024 -> 10, 1.6 M parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def cnn_bn() -> nn.Module:
    """Three conv-BatchNorm-ReLU blocks on 3x32x32 images, 60 k parameters."""
    torch.manual_seed(0)
    layers = [*_conv_bn(3, 32), *_conv_bn(32, 64, 2), *_conv_bn(64, 64, 2)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


MODELS = {"mlp": ("mlp", "512"), "cnn-bn": ("cnn_bn", "3,32,32")}  # factory, per-sample input shape


def _cases(text: str) -> list[tuple[str, int]]:
    cases = []
    for item in text.split(","):
        name, _, batch = item.partition(":")
        if name not in MODELS or not batch.isdigit() or int(batch) < 2:
            raise SystemExit(f"--cases {text!r}: each is MODEL:BATCH, MODEL one of {', '.join(MODELS)}, BATCH >= 2")
        cases.append((name, int(batch)))
    return cases


def calibrate(cache: Path) -> float:
    """The machine's constants measured into ``cache``; seconds it took."""
    env = {**os.environ, "MULTIGPU_CACHE_DIR": str(cache), "PYTHONPATH": _pythonpath()}
    code = "from multigpu.cli._advise_calibrate import machine_constants; machine_constants(recalibrate=True)"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    return time.perf_counter() - start


def _constants_line(cache: Path) -> str:
    """The calibrated per-step terms a reader compares between runs (docs/planning.md), from the cache file."""
    (path,) = cache.glob("planner-machine-*.json")
    c = json.loads(path.read_text())
    return (
        f"  dp hand-off {c['thread_overhead_s'] * 1e3:.2f} ms, ddp step {c['ddp_step_s'] * 1e3:.2f} ms, "
        f"fsdp per group {c['host']['fsdp_group_s'] * 1e3:.2f} ms, all-reduce {c['allreduce_latency_s'] * 1e3:.2f} ms "
        f"+ {c['allreduce_busbw'] / 1e9:.2f} GB/s, gather {c['gather_latency_s'] * 1e3:.2f} ms + {c['gather_busbw'] / 1e9:.2f} GB/s"
    )


def _pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))


def advise_measure(name: str, batch: int, cache: Path, budget_s: float) -> dict:
    """``multigpu advise --measure --json`` of one case, with its cache folder."""
    factory, shape = MODELS[name]
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "-m", "multigpu", "advise", "--measure", "--json", "--no-figure", "--out", out]
        argv += ["--model", f"benchmarks.planner_accuracy:{factory}", "--input-shape", shape, "--devices", "1,2"]
        argv += ["--global-batch", str(batch), "--optimizer", "sgd-momentum", "--budget", str(budget_s)]
        env = {**os.environ, "MULTIGPU_CACHE_DIR": str(cache), "PYTHONPATH": _pythonpath()}
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=budget_s * 3 + 300)
    if done.returncode != 0:
        raise RuntimeError(f"advise --measure {name}:{batch} failed: {done.stdout[-400:]}{done.stderr[-400:]}")
    return json.loads(done.stdout)


def _pair_rows(name: str, batch: int, result: dict, wall: float, load: float) -> list[dict]:
    """One pair (a prediction and its measurement) per strategy of one ``advise --measure`` run."""
    parts = {(r["strategy"], r["devices"]): r["parts_ms"] for r in result["rows"]}
    calibrated = {k: result["inputs"].get(k) for k in ("compute_ms_per_sample", "contention", "single_speedup")}
    return [
        {
            "model": name,
            "batch": batch,
            "strategy": row["strategy"],
            "devices": row["devices"],
            "predicted_ms": row["predicted_step_ms"],
            "measured_ms": row["step_ms"],
            "steps": row["steps"],
            "error": row["step_error"],
            "status": row["status"],
            "reason": row["reason"],
            "advise_wall_s": wall,
            "load": load,
            "predicted_parts_ms": parts.get((row["strategy"], row["devices"]), {}),
            "calibrated": calibrated,
        }
        for row in result["measured"]["rows"]
    ]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(pairs: list[dict], tolerance: float) -> list[dict]:
    """Per case and strategy, the medians of its pairs' predictions, measurements and errors; ``ok`` when
    every pair ran and the median error is within ``tolerance``."""
    rows: dict[tuple, dict] = {}
    for p in pairs:
        key = (p["model"], p["batch"], p["strategy"], p["devices"])
        row = rows.setdefault(
            key,
            {"model": p["model"], "batch": p["batch"], "strategy": p["strategy"], "devices": p["devices"], "pairs": []},
        )
        row["pairs"].append(p)
    for row in rows.values():
        ran = [p for p in row["pairs"] if p["error"] is not None]
        row["error"] = _median([p["error"] for p in ran])
        row["predicted_ms"] = _median([p["predicted_ms"] for p in ran])
        row["measured_ms"] = _median([p["measured_ms"] for p in ran])
        row["load"] = statistics.mean(p["load"] for p in row["pairs"])
        row["steps"] = min((p["steps"] or 0) for p in row["pairs"])
        row["ok"] = len(ran) == len(row["pairs"]) and abs(row["error"]) <= tolerance
    return list(rows.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"MODEL:GLOBAL_BATCH, comma-separated ({DEFAULT_CASES})")
    parser.add_argument("--budget", type=float, default=40.0, help="seconds of measuring per case (advise --budget)")
    parser.add_argument(
        "--pairs", type=int, default=3, help="advise --measure runs per case: each a prediction and its measurement (3)"
    )
    parser.add_argument("--tolerance", type=float, default=0.30, help="largest |predicted / measured - 1| that passes")
    parser.add_argument(
        "--with-feedback", action="store_true", help="each case's measurement feeds the next case's constants"
    )
    parser.add_argument("--json", type=Path, help="also write every pair as JSON here")
    args = parser.parse_args()
    cases = _cases(args.cases)
    if args.pairs < 1:
        raise SystemExit(f"--pairs {args.pairs}: at least 1 advise --measure run per case")
    revision = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, revision {revision}, "
        f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f} at the start"
    )
    pairs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="planner-accuracy-") as folder:
        pristine = Path(folder, "calibrated")
        print(f"machine constants measured in {calibrate(pristine):.1f} s (advise's first run on a machine)")
        print(_constants_line(pristine))
        shared = Path(folder, "shared")
        shutil.copytree(pristine, shared)
        # pair by pair over the cases (case 1, case 2, ..., then case 1 again): a slow drift of the
        # machine's state reaches every case alike, not all the pairs of one case
        for index in range(args.pairs):
            for name, batch in cases:
                cache = shared if args.with_feedback else Path(folder, f"{name}-{batch}-{index}")
                if not args.with_feedback:
                    shutil.copytree(pristine, cache)
                start, load = time.perf_counter(), os.getloadavg()[0]
                result = advise_measure(name, batch, cache, args.budget)
                wall, load = time.perf_counter() - start, (load + os.getloadavg()[0]) / 2
                pairs += _pair_rows(name, batch, result, wall, load)
                print(f"  pair {index + 1}/{args.pairs} of {name}:{batch} in {wall:.0f} s", flush=True)
    rows = summarize(pairs, args.tolerance)
    head = f"{'model':8s} {'batch':>5s} {'strategy':8s} {'N':>2s} {'pred ms':>8s} {'meas ms':>8s} {'error':>7s}"
    print(f"\n{head} {'pairs':>16s} {'load':>5s} {'steps':>5s}")
    for r in rows:
        pred = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] else "-"
        meas = f"{r['measured_ms']:.1f}" if r["measured_ms"] else "-"
        err = f"{r['error']:+.0%}" if r["error"] is not None else "-"
        each = "/".join(f"{p['error']:+.0%}" if p["error"] is not None else "-" for p in r["pairs"])
        print(
            f"{r['model']:8s} {r['batch']:5d} {r['strategy']:8s} {r['devices']:2d} {pred:>8s} {meas:>8s} {err:>7s}"
            f" {each:>16s} {r['load']:5.1f} {r['steps'] or '-':>5}"
            f"{'' if r['ok'] else '  <- beyond ' + format(args.tolerance, '.0%')}"
        )
    for p in pairs:
        if p["status"] != "ok":  # why a run has no measurement: the limit, or its last error line
            print(f"{p['model']}:{p['batch']} {p['strategy']} {p['status']}: {p['reason']}")
    for strategy in STRATEGIES:
        errors = [r["error"] for r in rows if r["strategy"] == strategy and r["error"] is not None]
        if errors:
            print(f"{strategy:8s} error from {min(errors):+.0%} to {max(errors):+.0%} over {len(errors)} cases")
    worst = max((abs(r["error"]) for r in rows if r["error"] is not None), default=0.0)
    sizes = [abs(p["error"]) for p in pairs if p["error"] is not None]
    beyond = sum(e > args.tolerance for e in sizes)
    print(
        f"worst |median error| {worst:.0%} (tolerance {args.tolerance:.0%}); of the {len(sizes)} single pairs "
        f"{beyond} beyond it, the worst {max(sizes, default=0.0):.0%}; load average {os.getloadavg()[0]:.2f} at the end"
    )
    if args.json:
        args.json.write_text(json.dumps(pairs, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
