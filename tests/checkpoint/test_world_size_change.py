"""Resume at another world size (2 -> 3 -> 2 ranks, same global batch) continues the same samples and weights.

One run trains 6 steps straight on 2 ranks; the other trains 2 steps on 2 ranks, resumes on 3 for
2 more, and on 2 again to step 6, each launch from the latest checkpoint with the loader's
position. Each step must train the same global batch (the union of the ranks' samples), and the
weights must match the straight run's (to float rounding: 3 ranks average their gradients in
another order than 2).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import multigpu
from tests.checkpoint.workers.world_size_worker import build_model
from tests.launching import multigpu_launch

WORKER = Path(__file__).parent / "workers" / "world_size_worker.py"
STEPS = 6

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]


def _train(strategy: str, nproc: int, folder: Path, out: Path, until: int) -> None:
    out.mkdir(exist_ok=True)
    done = multigpu_launch(
        "--strategy", strategy, "--nproc-per-node", str(nproc), str(WORKER),
        "--strategy", strategy, "--folder", str(folder), "--out", str(out), "--until", str(until),
        timeout_s=240,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _samples(out: Path, step: int) -> list[int]:
    found = sorted(out.glob(f"samples-step{step}-rank*.txt"))
    assert found, f"no samples recorded for step {step}"
    return sorted(int(i) for f in found for i in f.read_text().split())


def _weights(folder: Path, step: int) -> dict[str, torch.Tensor]:
    saved = folder / f"step-{step:08d}"  # ddp: model.safetensors in it; fsdp: the folder is DCP's, read whole
    one_file = saved / "model.safetensors"
    return dict(multigpu.load(build_model(), one_file if one_file.exists() else saved).state_dict())


@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        pytest.param(  # fsdp's resume at another world size stays in every run: test_sharded_multiprocess.py
            "fsdp", marks=pytest.mark.skipif(not os.environ.get("MULTIGPU_LONG"), reason="40 s: MULTIGPU_LONG=1")
        ),
    ],
)
def test_resume_at_2_then_3_then_2_ranks_continues_the_same_samples_and_weights(tmp_path: Path, strategy: str) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(strategy, 2, tmp_path / "ckpt-straight", straight, STEPS)
    for nproc, until in ((2, 2), (3, 4), (2, STEPS)):
        _train(strategy, nproc, tmp_path / "ckpt-split", split, until)
    assert len(list(split.glob("samples-step3-rank*.txt"))) == 3  # steps 3 and 4 ran on 3 ranks
    for step in range(1, STEPS + 1):
        assert _samples(split, step) == _samples(straight, step), f"step {step} trained other samples"
        assert len(_samples(split, step)) == 6
    want = _weights(tmp_path / "ckpt-straight", STEPS)
    got = _weights(tmp_path / "ckpt-split", STEPS)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    moved = _weights(tmp_path / "ckpt-split", 2)
    assert any(not torch.equal(moved[k], want[k]) for k in want)  # training moved the weights after step 2
