"""The Checkpointer under fsdp with two real gloo processes (``multigpu launch --strategy fsdp``).

Two launches share the work (tests/checkpoint/workers/fsdp_worker.py): the first trains 3 steps
saving each, and one rank SIGKILLs itself at a random file-system event of the 4th save; the
second resumes at world size 2 and trains to step 6, then trains the same 6 steps straight in the
same processes, and last tries a damaged copy of the latest checkpoint on both ranks. The tests
then load, inspect and convert the checkpoints in this process, at world size 1.

The kill point is drawn at random; the draw is printed (``pytest -s``) and ``MULTIGPU_KILL_SEED=S``
repeats it. ``MULTIGPU_LONG=1`` adds kills at 6 more random points (``MULTIGPU_KILL_CASES=N``: N),
one launch each.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import sklearn.datasets  # noqa: F401 (see below)
import torch
import torch._dynamo  # see below
import torch.distributed as dist

import multigpu
import multigpu.checkpoint as ckpt
from multigpu.checkpoint.atomic import is_temporary
from multigpu.checkpoint.formats import read_tensors
from multigpu.cli.main import main
from tests.checkpoint import _sharded as sh
from tests.checkpoint import _training as tr
from tests.launching import run_command

WORKER = Path(__file__).parent / "workers" / "fsdp_worker.py"
STEPS_BEFORE_KILL, STEPS = 3, 6
LONG_KILLS = int(os.environ.get("MULTIGPU_KILL_CASES", "6" if os.environ.get("MULTIGPU_LONG") else "0"))

# Both set environment variables when first imported (scikit-learn, for the digits: KMP_*; DCP's
# first use imports torch._dynamo: TORCHINDUCTOR_CACHE_DIR): imported with this module, not inside
# a test, whose guard (tests/conftest.py) would take them for the test's own changes.

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300 + 90 * LONG_KILLS)]


@dataclass(frozen=True)
class Killed:
    root: Path
    snapshot: Path  # the checkpoint folder as the kill left it
    rank: int
    fraction: float
    where: str  # the event the killed rank stopped at (from the worker)
    output: str


def _launch(root: Path, folder: Path, *args: str, timeout_s: float = 150) -> tuple[int, str]:
    done = run_command(
        [
            sys.executable,
            "-m",
            "multigpu",
            "launch",
            "--strategy",
            "fsdp",
            "--nproc-per-node",
            "2",
            str(WORKER),
            "--folder",
            str(folder),
            "--out",
            str(root),
            "--data",
            str(root / "digits.safetensors"),
            *args,
        ],
        timeout_s=timeout_s,
    )
    return done.returncode, done.stdout + done.stderr


def _kill_run(root: Path, rng: random.Random, steps: int) -> Killed:
    root.mkdir(parents=True, exist_ok=True)
    tr.write_digits(root / "digits.safetensors")
    rank, fraction = rng.randrange(2), rng.random()
    print(f"\n[kill] rank {rank} at {fraction:.3f} of its first save's file-system events")
    folder = root / "ckpt"
    code, output = _launch(
        root,
        folder,
        "--phase",
        "interrupt",
        "--steps",
        str(steps),
        "--kill-rank",
        str(rank),
        "--kill-fraction",
        str(fraction),
    )
    assert code != 0, output[-3000:]
    report = root / f"killed-rank{rank}.txt"
    assert report.exists(), f"rank {rank} was not killed\n{output[-3000:]}"
    snapshot = root / "after-kill"
    shutil.copytree(folder, snapshot, symlinks=True)
    return Killed(root, snapshot, rank, fraction, report.read_text().strip(), output)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Killed:
    seed = int(os.environ.get("MULTIGPU_KILL_SEED", random.randrange(1 << 30)))
    print(f"\n[kill] MULTIGPU_KILL_SEED={seed}")
    return _kill_run(tmp_path_factory.mktemp("fsdp-ckpt"), random.Random(seed), STEPS_BEFORE_KILL)


@pytest.fixture(scope="module")
def resumed(killed: Killed) -> Path:
    code, output = _launch(killed.root, killed.root / "ckpt", "--phase", "resume", "--steps", str(STEPS))
    assert code == 0, output[-3000:]
    return killed.root


def _check_kill_left_a_whole_checkpoint(killed: Killed, steps: int) -> None:
    """The previous checkpoint is complete, loads, and holds the weights recorded at its save; the latest is whole."""
    print(f"[kill] rank {killed.rank} stopped at event {killed.where}")
    latest = ckpt.find_latest(killed.snapshot)
    assert latest is not None and latest.name in (f"step-{steps:08d}", f"step-{steps + 1:08d}"), latest
    previous = killed.snapshot / f"step-{steps:08d}"
    for folder in {previous, latest}:
        model = tr.build_model()
        with pytest.warns(RuntimeWarning, match=r"resuming at world_size=1 from a checkpoint saved at world_size=2"):
            back = ckpt.Checkpointer(folder=killed.snapshot).resume(model=model, path=folder)
        assert back is not None and back.saved_world_size == 2
        if folder == previous:
            want = read_tensors(killed.root / f"weights-{steps}.safetensors")[0]
            assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)


def test_a_sigkill_of_either_rank_mid_save_leaves_the_previous_checkpoint_whole(killed: Killed) -> None:
    _check_kill_left_a_whole_checkpoint(killed, STEPS_BEFORE_KILL)


def test_resume_at_world_size_2_continues_bit_for_bit(resumed: Path) -> None:
    start, world = (resumed / "resumed-from-rank0.txt").read_text().split()
    assert int(start) in (STEPS_BEFORE_KILL, STEPS_BEFORE_KILL + 1) and world == "2"
    got, want = read_tensors(resumed / "resumed.safetensors")[0], read_tensors(resumed / "straight.safetensors")[0]
    assert all(torch.equal(got[k], want[k]) for k in want)
    for rank in (0, 1):  # each rank's optimizer slices (AdamW step, exp_avg, exp_avg_sq, lr) and random states
        after_resume = torch.load(resumed / f"resumed-rank{rank}.pt", weights_only=True)
        straight = torch.load(resumed / f"straight-rank{rank}.pt", weights_only=True)
        assert str(after_resume) == str(straight)
        for key, state in straight["optimizer"]["state"].items():
            assert all(torch.equal(after_resume["optimizer"]["state"][key][k], v) for k, v in state.items())
    # The next save deleted what the kill left behind (this host, a dead process).
    assert not [p.name for p in (resumed / "ckpt").iterdir() if is_temporary(p)]
    assert ckpt.Checkpointer(folder=resumed / "ckpt").steps() == [STEPS - 1, STEPS]


def test_loading_at_world_size_1_warns_and_gives_the_saved_state(resumed: Path) -> None:
    run = sh.build_run(tr.build_model())
    with pytest.warns(RuntimeWarning, match=r"resuming at world_size=1 from a checkpoint saved at world_size=2"):
        back = ckpt.Checkpointer(folder=resumed / "ckpt").resume(
            model=run.model, optimizer=run.optimizer, scheduler=run.scheduler
        )
    assert back is not None and back.step == STEPS and back.saved_world_size == 2
    want = read_tensors(resumed / "resumed.safetensors")[0]
    assert all(torch.equal(run.model.state_dict()[k], want[k]) for k in want)
    assert [float(s["step"]) for s in run.optimizer.state_dict()["state"].values()] == [float(STEPS)] * 4
    assert run.scheduler.state_dict()["last_epoch"] == STEPS
    bare = multigpu.load(tr.build_model(), resumed / "ckpt" / f"step-{STEPS:08d}")  # the weights alone
    assert all(torch.equal(bare.state_dict()[k], want[k]) for k in want)


def test_loading_into_a_model_sharded_over_one_rank_reshards_the_two_ranks_slices(resumed: Path) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run = sh.build_run(sh.sharded_model())
        with pytest.warns(RuntimeWarning, match=r"resuming at world_size=1 from a checkpoint saved at world_size=2"):
            back = ckpt.Checkpointer(folder=resumed / "ckpt").resume(model=run.model, optimizer=run.optimizer)
        assert back is not None and back.step == STEPS
        got, want = sh.full_weights(run.model), read_tensors(resumed / "resumed.safetensors")[0]
        assert all(torch.equal(got[k], want[k]) for k in want)
        exp_avg = [sh.local(s["exp_avg"]) for s in run.optimizer.state_dict()["state"].values()]
        assert [tuple(t.shape) for t in exp_avg] == [(48, 64), (48,), (10, 48), (10,)]  # whole: one rank holds all
    finally:
        dist.destroy_process_group()


def test_inspect_and_convert_give_the_whole_weights(
    resumed: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "500")  # the path is folded at the terminal's width, and tmp paths are long
    assert main(["ckpt", "inspect", str(resumed / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert f"step-{STEPS:08d}" in out and "dcp (torch.distributed.checkpoint, sharded)" in out
    assert f"saved step        {STEPS}" in out and "world_size        2" in out and "shard files       2" in out
    assert "0.weight" in out and "[48, 64]" in out and "3.weight" in out and "[10, 48]" in out
    converted = resumed / "converted.safetensors"
    assert main(["ckpt", "convert", str(resumed / "ckpt"), str(converted)]) == 0
    bare = multigpu.load(tr.build_model(), converted)
    want = read_tensors(resumed / "resumed.safetensors")[0]  # gathered by multigpu.save at the same step
    assert sorted(bare.state_dict()) == sorted(want)
    assert all(torch.equal(bare.state_dict()[k], want[k]) for k in want)


def test_a_damaged_checkpoint_fails_every_rank_with_the_same_cause(resumed: Path) -> None:
    # Rank 1 checks the CRC-32 of rank 0's file and finds the flipped byte; rank 0's own checks
    # pass, and it must still stop (not wait in DCP's collectives for a rank that gave up).
    rank0 = (resumed / "damaged-rank0.txt").read_text().splitlines()[1]
    rank1 = (resumed / "damaged-rank1.txt").read_text().splitlines()[1]
    cause = r"__0_0\.distcp' does not match the CRC-32 its manifest records"
    assert re.match(r"CheckpointError: .*" + cause, rank1), rank1
    assert re.search(
        r"CheckpointError: rank 1 refused the checkpoint, so every rank stops: CheckpointError: .*" + cause, rank0
    ), rank0


@pytest.mark.skipif(not LONG_KILLS, reason="one launch per kill: MULTIGPU_LONG=1 or MULTIGPU_KILL_CASES=N")
def test_sigkills_at_many_points_of_a_sharded_save_lose_nothing(tmp_path: Path) -> None:
    seed = int(os.environ.get("MULTIGPU_KILL_SEED", random.randrange(1 << 30)))
    print(f"\n[kill] MULTIGPU_KILL_SEED={seed}, {LONG_KILLS} kills")
    rng = random.Random(seed)
    for case in range(LONG_KILLS):
        _check_kill_left_a_whole_checkpoint(_kill_run(tmp_path / f"kill-{case}", rng, steps=1), steps=1)
