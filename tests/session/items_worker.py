"""Worker for the token-weighting tests: every drawn case under ddp and under fsdp, in one launch.

    multigpu launch --strategy ddp --nproc-per-node N tests/session/items_worker.py OUT_DIR CASES.json

Each case trains in a fresh Session (ddp, then fsdp) in the same process group; rank 0 writes
OUT_DIR/results.pt, ``{strategy: [per-case result]}``, which tests/session/test_items.py checks
against the one-device oracle.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from item_cases import ItemCase, train_items

from multigpu.session import Session


def main(out: Path, cases_file: Path) -> None:
    cases = [ItemCase.from_json(c) for c in json.loads(cases_file.read_text())]
    warnings.filterwarnings("ignore", message="fsdp on cpu in a process started without")
    results: dict[str, list[object]] = {"ddp": [], "fsdp": []}
    with Session(strategy="ddp", timeout_s=120) as outer:  # holds the process group for every case's Session
        for strategy in results:
            for case in cases:
                with Session(strategy=strategy, accumulate=case.accumulate, seed=case.seed) as session:
                    assert session.world_size == case.world_size, (session.world_size, case)
                    results[strategy].append(train_items(session, case))
        if outer.is_main_process:
            torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
