"""The GPU check's steps, run one after another into one report folder (``./scripts/gpu-check`` calls it).

    python scripts/gpu_check.py                      # every step, on cuda:0, into gpu-report/
    python scripts/gpu_check.py --only demo,copies   # some steps
    python scripts/gpu_check.py --allow-cpu --only env,dp-overhead   # the plumbing, on a machine without GPU

Steps: ``env`` (versions and devices), ``cuda-tests`` (the tests marked ``cuda``), ``demo`` (the demo on
the GPUs), ``dp-overhead`` (DataParallel on one GPU against the bare module, and a CPU batch into a
CUDA model), ``ddp-step`` (a 1-process nccl DDP run through ``multigpu launch``), ``bandwidth``
(``multigpu bandwidth``: host<->device, device<->device when there are two GPUs, the DataParallel
pattern) and ``copies`` (device->device on one GPU, host->device pinned and pageable).

Each step's output goes to ``<out>/<step>.log``; ``report.md`` and ``report.json`` say what passed, in
how long, with each probe's figures. The whole check keeps to a time budget (default 7.5 minutes):
a step gets at most what is left of it. Exit status: 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

_PY = sys.executable
_MULTIGPU = [_PY, "-m", "multigpu"]
_SHORT_RUN = ["--epochs", "1", "--max-steps", "10"]  # a few DDP steps: enough to show nccl works


@dataclass(frozen=True)
class Step:
    """One step: a command, its own time limit, and whether its last output line is a JSON result."""

    name: str
    command: list[str]
    timeout_s: float
    json_result: bool = False


@dataclass
class Outcome:
    name: str
    status: str  # "passed", "failed", "timed out", "skipped"
    seconds: float
    result: dict[str, object] | None
    log: str


def build_steps(device: str, out: Path) -> list[Step]:
    """The steps in order, for ``device`` (``cuda:0``, or ``cpu`` for a dry run)."""
    gpu = device.startswith("cuda")
    probes = [_PY, "scripts/gpu_probes.py"]
    return [
        Step("env", [_PY, "-m", "multigpu", "env", "--json"], 60, json_result=True),
        Step("cuda-tests", [_PY, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests"], 240),
        Step("demo", [_PY, "-m", "multigpu", "demo", "--epochs", "3", "--out", str(out / "demo")], 240),
        Step(
            "dp-overhead",
            [*probes, "dp-overhead", "--device", device, *([] if gpu else ["--batch", "16", "--iters", "2"])],
            90,
            json_result=True,
        ),
        Step(
            "ddp-step",
            [*_MULTIGPU, "launch", "--strategy", "ddp", "--nproc-per-node", "1", "examples/train.py", *_SHORT_RUN],
            120,
        ),
        Step(
            "bandwidth",
            [
                *_MULTIGPU,
                "bandwidth",
                "--max-size",
                "256MiB" if gpu else "4MiB",
                "--no-all-reduce",
                "--out",
                str(out / "bandwidth"),
            ],
            120,
        ),
        Step("copies", [*probes, "copies", "--device", device, *([] if gpu else ["--bytes", "4194304"])], 60, True),
    ]


def run_step(step: Step, out: Path, budget_s: float) -> Outcome:
    """Run one step with its output in ``<out>/<name>.log``, stopped after its limit or the budget left."""
    log = out / f"{step.name}.log"
    limit = min(step.timeout_s, budget_s)
    if limit <= 1:
        return Outcome(step.name, "skipped", 0.0, None, str(log))
    began = time.monotonic()
    with log.open("w") as handle:
        try:
            done = subprocess.run(step.command, stdout=handle, stderr=subprocess.STDOUT, timeout=limit, check=False)
            status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit:.0f} s"
    seconds = time.monotonic() - began
    result = _last_json(log) if step.json_result and status == "passed" else None
    return Outcome(step.name, status, seconds, result, str(log))


def _last_json(log: Path) -> dict[str, object] | None:
    text = log.read_text(errors="replace").strip()
    for start in (0, text.rfind("\n{") + 1):  # a whole-file object (env --json) or a last-line one
        try:
            value = json.loads(text[start:])
        except json.JSONDecodeError:
            continue
        return value if isinstance(value, dict) else None
    return None


def write_report(outcomes: list[Outcome], out: Path, device: str) -> Path:
    """``report.json`` (everything) and ``report.md`` (a table a person reads first)."""
    (out / "report.json").write_text(json.dumps({"device": device, "steps": [asdict(o) for o in outcomes]}, indent=2))
    lines = [f"# GPU check on {device}", "", "| step | status | seconds | figures |", "|---|---|---:|---|"]
    for o in outcomes:
        figures = "" if o.result is None or o.name == "env" else ", ".join(f"{k}={v}" for k, v in o.result.items())
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.1f} | {figures} |")
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def _cuda_available() -> bool:
    from multigpu.devices import get_device_type  # imported here (it imports torch): --help stays fast

    return get_device_type("cuda").is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-report", help="report folder (default gpu-report)")
    parser.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated steps to leave out")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU when no GPU is visible (dry run)")
    args = parser.parse_args(argv)
    gpu = _cuda_available()
    if not gpu and not args.allow_cpu:
        print("gpu-check: no CUDA device is visible; run it on a machine with a GPU (or --allow-cpu for a dry run)")
        return 2
    device = "cuda:0" if gpu else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = build_steps(device, out)
    names = {s.name for s in steps}
    chosen = {n for n in args.only.split(",") if n} or names
    unknown = (chosen | {n for n in args.skip.split(",") if n}) - names
    if unknown:
        print(f"gpu-check: unknown step(s) {sorted(unknown)}; the steps are {[s.name for s in steps]}")
        return 2
    deadline = time.monotonic() + args.budget
    outcomes: list[Outcome] = []
    for step in [s for s in steps if s.name in chosen and s.name not in args.skip.split(",")]:
        print(f"gpu-check: {step.name} ...", flush=True)
        outcomes.append(run_step(step, out, deadline - time.monotonic()))
        print(f"gpu-check: {step.name}: {outcomes[-1].status} ({outcomes[-1].seconds:.1f} s)", flush=True)
    report = write_report(outcomes, out, device)
    print(report.read_text())
    return 0 if all(o.status == "passed" for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
