"""Run as a script: the fewest page faults of a training step of the small CNN in this process, and its large allocations.

    python tests/planning/_page_faults.py   (prints JSON: minor faults per step, allocations counted)

tests/planning/test_allocations.py starts it with and without fsdp's malloc settings.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests` imports

from multigpu.devices.cpu import SHARDED_MMAP_THRESHOLD
from multigpu.planning.allocations import large_allocations
from tests.planning._reference_nets import small_cnn

STEPS = 5  # the fewest faults of these steps is kept: a step the kernel reclaimed pages under (a loaded machine) faults more


def main() -> None:
    torch.set_num_threads(1)
    model, x = small_cnn(), torch.randn(16, 3, 32, 32)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    step()
    step()
    counts = []
    for _ in range(STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    faults = min(counts)
    large = large_allocations(step, threshold=SHARDED_MMAP_THRESHOLD)
    print(json.dumps({"faults_per_step": faults, "count": large.count, "bytes": large.bytes}))


if __name__ == "__main__":
    main()
