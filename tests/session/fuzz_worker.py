"""ddp worker of the Session's differential fuzzer: every drawn case in one launch (launches are slow).

    multigpu launch --strategy ddp --nproc-per-node 2 tests/session/fuzz_worker.py CASES.json OUT_DIR

Each rank trains every case of CASES.json with a fresh ddp Session in the same process group and
writes OUT_DIR/rank<R>.pt: one final state dict per case, in order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_cases import Case, run_case

from multigpu.session import Session


def main() -> None:
    cases = [Case.from_json(data) for data in json.loads(Path(sys.argv[1]).read_text())]
    out = Path(sys.argv[2])
    with Session(strategy="ddp", timeout_s=120) as session:  # opens the group each case's Session joins
        results = [run_case(case, "ddp") for case in cases]
        torch.save(results, out / f"rank{session.global_rank}.pt")


if __name__ == "__main__":
    main()
