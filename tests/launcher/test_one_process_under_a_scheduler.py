"""``srun multigpu launch --strategy single|dp``: the launcher is the scheduler's task, its one child is not.

The child inherits SLURM's (or MPI's) variables; it must not read them as its own world (a world of the
step's tasks), and a one-process strategy on several nodes is refused before anything starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from multigpu.errors import ConfigError
from multigpu.launcher.launch import LaunchConfig
from multigpu.runtime.world import read_launch_env
from tests.launching import run_command

_SCRIPT = """
from multigpu.runtime.world import read_launch_env
from multigpu.session import Session
env = read_launch_env()
with Session(strategy="{strategy}") as session:
    print("world", None if env is None else env.scheduler, session.world_size, flush=True)
"""
_ONE_TASK_STEP = {  # 'srun --ntasks=1 multigpu launch ...'
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1",
    "SLURM_STEP_NODELIST": "127.0.0.1",
}


def test_the_child_of_a_one_process_launch_has_no_scheduler_world() -> None:
    assert read_launch_env({**_ONE_TASK_STEP, "MULTIGPU_STRATEGY": "single"}) is None
    mpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MULTIGPU_STRATEGY": "dp"}
    assert read_launch_env(mpi) is None
    assert read_launch_env({**_ONE_TASK_STEP, "MULTIGPU_STRATEGY": "ddp", "RANK": "0", "WORLD_SIZE": "1"}) is not None


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_srun_multigpu_launch_one_process(tmp_path: Path, strategy: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(strategy=strategy))
    argv = [sys.executable, "-m", "multigpu", "launch", "--strategy", strategy, str(script)]
    done = run_command(argv, env=_ONE_TASK_STEP, timeout_s=90)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world None 1" in done.stdout


def test_a_one_process_strategy_on_several_nodes_is_refused() -> None:
    # 'srun --nodes=2 --ntasks-per-node=1 multigpu launch --strategy single': the scheduler says 2 nodes
    with pytest.raises(ConfigError, match=r"--strategy single runs one process, but nnodes='2'.*--strategy ddp"):
        LaunchConfig(strategy="single", nnodes="2", master_addr="10.0.0.1")
