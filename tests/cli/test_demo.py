"""The main job, end to end at a small size: real training, the table, both figures.

This is the one run of the whole demo in the suite (its DDP run launches real processes): the
table it prints is checked here, DDP against one device included.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from multigpu.cli.main import main


@pytest.mark.multiprocess
def test_demo_trains_every_run_and_writes_its_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--epochs", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for run in ("one device", "DataParallel, 2 replicas", "DataParallel, balanced, 2 replicas", "DDP, 2 processes"):
        assert run in out  # every label says how many replicas or processes it ran
    assert "warm-up (every run, untimed)" in out and "step 1" in out
    # DDP's row: the same global batches as one device (1 epoch = 12 steps, the last batch of 29 does
    # not divide by 2), so its weights end within float32 rounding of the one-device run's
    ddp_row = [line for line in out.splitlines() if "DDP, 2 processes" in line][-1]  # the table, after the bar
    first_step, end = (float(x) for x in re.findall(r"\d\.\de[-+]\d\d", ddp_row))
    assert first_step < 1e-6 and end < 1e-4, ddp_row
    for name in ("loss_curves.png", "memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_help_explains_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--devices" in out and "global batch size" in out
