"""The one ddp launch the session tests share: every scenario and every drawn fuzz case (launches are slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launching import launch_workers
from tests.session.fuzz_cases import ddp_cases

WORKER = Path(__file__).with_name("ddp_worker.py")


@pytest.fixture(scope="session")
def ddp_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the shared ddp launch writes into."""
    return tmp_path_factory.mktemp("ddp")


@pytest.fixture(scope="session")
def ranks(ddp_out: Path) -> list[dict[str, Any]]:
    """What each of two real gloo processes wrote (tests/session/ddp_worker.py), rank 0 first."""
    out = ddp_out
    cases = out / "cases.json"
    drawn = ddp_cases()
    cases.write_text(json.dumps([case.to_json() for case in drawn]))
    launch_workers(WORKER, str(out), str(cases), timeout_s=150 + 2 * len(drawn))
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
