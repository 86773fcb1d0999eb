"""Fault-tolerant replica groups: the step's cost against plain ddp, and what a SIGKILL costs.

    pip install -e '.[fault-tolerant]'
    python benchmarks/fault_tolerance.py                   # 3 repeats of 300 steps each way, then the kills
    python benchmarks/fault_tolerance.py --repeats 5 --steps 500
    python benchmarks/fault_tolerance.py --kill-only --kills 5
    python benchmarks/fault_tolerance.py --step-only          # the step cost alone

Step cost: the same 1.4M-parameter MLP, data and global batch (64) under
``multigpu launch --strategy ddp --nproc-per-node 2`` (one process group of 2) and under
``multigpu launch --strategy ddp --fault-tolerant --replicas 2 --nproc-per-node 1`` (2 replica groups of 1,
which average their gradients through torchft's Manager), both with ``--no-bind-cores`` (the
fault-tolerant launch does not bind its groups). The two alternate within each repeat; the ratio is the
median over repeats of the per-repeat ratio of median step times (rank 0 of group 0 times each step, from
the end of one to the end of the next, after 20 warm-up steps). Target: at most 1.15. Load hides a fixed cost
per step (another process runs while a worker waits), so each run also reports the CPU-seconds per step that all
its processes spent together (the launcher with its lighthouse, the zygote, torchrun's agent, every worker; read
from /proc by rank 0 of group 0 after the warm-up and at the end), and the median over repeats of their ratio.

Kill: a fault-tolerant run of 2 groups, each step sleeping 100 ms (so the run outlasts the restarts). Group
1's worker is SIGKILLed at a random point of a step ``--kills`` times (each once its worker has committed 20
steps): its restarts fork from the launcher's zygote; then the zygote is killed and group 1 ``--kills`` times
more: those restarts start new interpreters (the fallback, and the way every restart went before the
zygote). Reported per kill and as medians per way: the restarted group's first committed step after its
process started and after the kill (targets 2 s and 5 s, on a quiet machine); the committed steps the
survivor lost at the first kill (its ``global_step`` never going back: target 0); and the time a fresh
interpreter takes to import torch, torchft and multigpu at that moment. This file is also the worker
(``--worker``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 20


def build_model() -> nn.Module:
    # 1024*1024 + 1024*384 + 384*10 weights and their biases: 1,447,050 parameters
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 384), nn.ReLU(), nn.Linear(384, 10))


def process_start_time() -> float:
    """This process's start, in the epoch's seconds: its age from /proc (start and uptime on one clock, 10 ms)."""
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - start)


def _stat(pid: int | str) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def launch_cpu_s() -> float:
    """CPU seconds (user + system, every thread) so far of every live process of this launch: the launcher (with
    its lighthouse), its zygote, torchrun's agent, every worker. The launcher is this worker's furthest ancestor
    that runs ``multigpu launch``."""
    launcher, pid = os.getpid(), os.getpid()
    while pid > 1:
        pid = int(_stat(pid)[1])
        with contextlib.suppress(OSError):
            if b"multigpu\x00launch" in Path(f"/proc/{pid}/cmdline").read_bytes():
                launcher = pid
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            children.setdefault(int(_stat(entry.name)[1]), []).append(int(entry.name))
    total, todo = 0.0, [launcher]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        with contextlib.suppress(OSError, IndexError):
            fields = _stat(pid)
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def worker(out: Path, steps: int, pause_s: float) -> None:
    from multigpu.session import Session

    started = process_start_time()
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64 * 40, 1024, generator=generator), torch.randint(0, 10, (64 * 40,), generator=generator)
    )
    with Session(strategy="ddp") as session:
        model = session.setup_model(build_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loader = session.build_loader(data, batch_size=64)
        times: list[float] = []
        cpu: list[float] = []  # the launch's CPU seconds after the warm-up and at the end (rank 0 of group 0)
        log = (out / f"group{session.replica_group}-rank{session.rank}.jsonl").open("a")
        last = time.perf_counter()
        while session.global_step < steps and not (out / "stop").exists():
            for x, y in session.batches(loader):
                with session.micro_step(model):
                    loss = nn.functional.cross_entropy(model(x), y)
                    session.backward(loss)
                    if pause_s and (out / "hold").exists():
                        time.sleep(pause_s)
                committed = session.step(optimizer)
                now = time.perf_counter()
                times.append(now - last)
                last = now
                if session.is_main_process and len(times) == WARMUP:
                    cpu.append(launch_cpu_s())
                record = {
                    "committed": committed,
                    "global_step": session.global_step,
                    "pid": os.getpid(),
                    "ppid": os.getppid(),
                }
                log.write(json.dumps({**record, "started": started, "time": time.time()}) + "\n")
                log.flush()
                if session.global_step >= steps or (out / "stop").exists():  # the kill run ends when it is done
                    break
        if session.is_main_process:
            cpu.append(launch_cpu_s())  # before the session closes: the other workers are still alive
            (out / "times.json").write_text(json.dumps(times[WARMUP:]))
            (out / "cpu.json").write_text(json.dumps((cpu[-1] - cpu[0]) / max(1, len(times) - WARMUP)))


def launch(flags: list[str], out: Path, steps: int, pause_s: float = 0.0) -> subprocess.Popen[bytes]:
    env = {**os.environ, "RUST_LOG": "warn", "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, "-m", "multigpu", "launch", "--strategy", "ddp", "--no-bind-cores", *flags]
    argv += [__file__, "--worker", str(out), str(steps), str(pause_s)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def median_step(flags: list[str], steps: int) -> tuple[float, float]:
    """The median step time of a run, and the CPU seconds per step that all its processes spent together."""
    with tempfile.TemporaryDirectory() as folder:
        proc = launch(flags, Path(folder), steps)
        if proc.wait(timeout=600) != 0:
            raise SystemExit(f"the run {flags} failed")
        times = json.loads((Path(folder) / "times.json").read_text())
        return statistics.median(times), json.loads((Path(folder) / "cpu.json").read_text())


def read(out: Path, group: int) -> list[dict]:
    path = out / f"group{group}-rank0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def kill_and_wait(out: Path, proc: subprocess.Popen[bytes], pause: float, deadline: float) -> dict[str, float]:
    """SIGKILL group 1's worker at a random point of a step; the restarted one's first commit after its start
    and after the kill, and whether it was forked (its parent is not the launcher)."""
    victim = read(out, 1)[-1]["pid"]
    time.sleep(random.uniform(0, pause))
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    gone = {r["pid"] for r in read(out, 1)}
    while not [r for r in read(out, 1) if r["pid"] not in gone and r["committed"]]:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the restarted group did not commit")
        time.sleep(0.01)
    back = next(r for r in read(out, 1) if r["pid"] not in gone and r["committed"])
    return {
        "after its process started": back["time"] - back["started"],
        "after the kill": back["time"] - killed_at,
        "forked": float(back["ppid"] != proc.pid),
        "killed at": killed_at,
    }


def settled(out: Path, steps: int) -> bool:
    """Group 1's current worker has committed ``steps`` steps (the run is back in its stride)."""
    rows = read(out, 1)
    return bool(rows) and sum(r["committed"] for r in rows if r["pid"] == rows[-1]["pid"]) >= steps


def zygote_of(launcher: int) -> int | None:
    """The launcher's zygote (its child running multigpu.launcher.fault_tolerant_zygote), if any."""
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher and b"fault_tolerant_zygote" in command:
            return int(entry.name)
    return None


def kill_run(steps: int, kills: int) -> tuple[dict[str, float], dict[str, list[dict[str, float]]]]:
    """``kills`` SIGKILLs of group 1 with the zygote, then the zygote killed, then ``kills`` more (new interpreters)."""
    pause = 0.1
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        restarts = 2 * kills + 1  # the zygote's death ends its forked worker: one restart more
        flags = ["--fault-tolerant", "--replicas", "2", "--nproc-per-node", "1", "--max-restarts", str(restarts)]
        (out / "hold").touch()
        proc = launch(flags, out, steps, pause)
        deadline = time.monotonic() + 600
        results: dict[str, list[dict[str, float]]] = {"zygote": [], "new interpreter": []}
        for mode in results:
            if mode == "new interpreter":
                zygote = zygote_of(proc.pid)
                if zygote is not None:
                    os.kill(zygote, signal.SIGKILL)
            for _ in range(kills):
                while not settled(out, 20):
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit("the fault-tolerant run did not settle before a kill")
                    time.sleep(0.01)
                results[mode].append(kill_and_wait(out, proc, pause, deadline))
                shown = {k: v for k, v in results[mode][-1].items() if k != "killed at"}
                print(f"{mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in shown.items()), flush=True)
        (out / "stop").touch()
        if proc.wait(timeout=600) != 0:
            raise SystemExit("the fault-tolerant run failed")
        survivor = [r["global_step"] for r in read(out, 0)]
        first_kill = results["zygote"][0]["killed at"]
        before = max(r["global_step"] for r in read(out, 0) if r["time"] <= first_kill)
        after = min(r["global_step"] for r in read(out, 0) if r["time"] > first_kill)
        lost = max(0, before - after)  # the survivor's first step after the kill starts from where it stood
        started = time.perf_counter()  # what a restarted worker spends importing, on this machine now
        subprocess.run([sys.executable, "-c", "import torch, torchft.manager, multigpu.session"], check=True)
        imports = time.perf_counter() - started
        summary = {
            "committed steps lost at the first kill": float(lost),
            "survivor never went back": float(all(b >= a for a, b in itertools.pairwise(survivor))),
            "a fresh interpreter importing torch, torchft and multigpu (s)": imports,
        }
        return summary, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-only", action="store_true", help="only the SIGKILL run")
    parser.add_argument("--step-only", action="store_true", help="only the step cost (no SIGKILL run)")
    parser.add_argument("--kills", type=int, default=5, help="kills with the zygote, then as many without")
    parser.add_argument("--worker", nargs=3, metavar=("OUT", "STEPS", "PAUSE"))
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), int(args.worker[1]), float(args.worker[2]))
        return
    plain = ["--nproc-per-node", "2"]
    tolerant = ["--fault-tolerant", "--replicas", "2", "--nproc-per-node", "1"]
    ratios, cpu_ratios = [], []
    for repeat in range(0 if args.kill_only else args.repeats):
        (a, a_cpu), (b, b_cpu) = median_step(plain, args.steps), median_step(tolerant, args.steps)
        ratios.append(b / a)
        cpu_ratios.append(b_cpu / a_cpu)
        print(
            f"repeat {repeat}: ddp {a * 1e3:.2f} ms ({a_cpu * 1e3:.2f} CPU-ms), fault-tolerant {b * 1e3:.2f} ms "
            f"({b_cpu * 1e3:.2f} CPU-ms), ratio {b / a:.3f} (CPU {b_cpu / a_cpu:.3f})",
            flush=True,
        )
    if ratios:
        print(
            f"fault-tolerant step / ddp step: median {statistics.median(ratios):.3f} (target <= 1.15); CPU-seconds "
            f"per step of all the run's processes: median {statistics.median(cpu_ratios):.3f}"
        )
    if args.step_only:
        return
    summary, results = kill_run(100_000, args.kills)
    for name, value in summary.items():
        print(f"{name}: {value:.3f}")
    for mode, rows in results.items():
        started = statistics.median(r["after its process started"] for r in rows)
        killed = statistics.median(r["after the kill"] for r in rows)
        forked = sum(int(r["forked"]) for r in rows)
        print(
            f"restarted by {mode} ({forked} of {len(rows)} forked): first commit {started:.3f} s after its process "
            f"started, {killed:.3f} s after the kill (medians of {len(rows)}; targets 2 s and 5 s)"
        )


if __name__ == "__main__":
    main()
