"""One DataParallel training step under two revisions of multigpu, rounds interleaved: did a change slow it?

    python benchmarks/compare_revisions.py 949f8a2 HEAD [--rounds 10] [--steps 20] [--model mlp] [--devices cpu:2]

Each revision's ``src/`` is exported with ``git archive`` into a temporary folder; every round runs
the step of ``benchmarks/step_time.py`` (this checkout's, so both revisions time the same loop) in a
fresh process per revision, the two in alternating order, with multigpu imported from that
revision. Prints each revision's median ms/step over rounds, ``second / first`` of the medians and
the median of the per-round ratios, with the load average before and after. Only the public
``multigpu.DataParallel`` is used, so any two revisions compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in a child: the revision's src first on the path, this checkout's benchmarks for the loop.
_CHILD = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import multigpu, step_time
assert multigpu.__file__.startswith(sys.argv[1]), multigpu.__file__
model, n = sys.argv[3], step_time.MODELS[sys.argv[3]]
bare = step_time.build(model)
x, y = step_time.batch(model, n)
wrapped = multigpu.DataParallel(bare, devices=sys.argv[4])
print(step_time.median_ms(step_time.make_step(wrapped, bare, x, y), int(sys.argv[5])))
"""


def export_src(revision: str, into: Path) -> Path:
    """``revision``'s ``src/`` under ``into`` (``git archive``: the checkout itself is left alone)."""
    archive = into / f"{revision.replace('/', '_')}.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(ROOT), "archive", revision, "src"], check=True, stdout=out)
    folder = into / revision.replace("/", "_")
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return folder / "src"


def time_step(src: Path, args: argparse.Namespace) -> float:
    command = [
        sys.executable,
        "-c",
        _CHILD,
        str(src),
        str(ROOT / "benchmarks"),
        args.model,
        args.devices,
        str(args.steps),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=src.parent)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", help="a git revision (e.g. the commit before a change)")
    parser.add_argument("second", help="another git revision (e.g. HEAD)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round and revision (default 20)")
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp", help="step_time.py's model (default mlp)")
    parser.add_argument("--devices", default="cpu:2", help="DataParallel's devices (default cpu:2)")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="multigpu-revisions-") as tmp:
        srcs = {rev: export_src(rev, Path(tmp)) for rev in (args.first, args.second)}
        times: dict[str, list[float]] = {rev: [] for rev in srcs}
        for r in range(args.rounds):
            order = list(srcs) if r % 2 == 0 else list(reversed(srcs))
            for rev in order:
                times[rev].append(time_step(srcs[rev], args))
            print(f"round {r + 1}: " + ", ".join(f"{rev} {times[rev][-1]:.2f} ms" for rev in srcs), flush=True)
    first, second = (statistics.median(times[rev]) for rev in (args.first, args.second))
    paired = statistics.median(b / a for a, b in zip(times[args.first], times[args.second]))
    print(f"{args.model} on {args.devices}: {args.first} {first:.2f} ms, {args.second} {second:.2f} ms per step")
    print(f"{args.second} / {args.first}: {second / first:.3f} (medians), {paired:.3f} (median of per-round ratios)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
