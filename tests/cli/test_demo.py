"""The main job, end to end at a small size: real training, the table, both figures."""

from __future__ import annotations

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
    for name in ("loss_curves.png", "memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_help_explains_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "--devices" in out and "global batch size" in out
