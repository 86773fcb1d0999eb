"""Every start path, with real gloo processes on loopback: SLURM's and MPI's variables on two plain
processes, two ``multigpu launch`` under torchrun's ``PET_*``; each forms one world whose final
weights equal one process's (plain torch, same seed, same global batches)."""

from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path

import pytest
import torch

from multigpu.runtime.schedulers import TORCHRUN, slurm_port
from tests.launching import run_together
from tests.runtime.preempt_worker import oracle

pytestmark = pytest.mark.multiprocess

WORKER = "tests/runtime/preempt_worker.py"
STEPS = 3
LONG = bool(os.environ.get("MULTIGPU_LONG"))


def free_port(low: int = 1, high: int = 65535) -> int:
    """A port nothing listens on now, in [low, high) (0 picks one the kernel chooses when the range is all)."""
    for _ in range(200):
        port = 0 if (low, high) == (1, 65535) else random.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise AssertionError(f"no free port in [{low}, {high})")


def _check_one_world(done: list, folder: Path, scheduler: str) -> None:
    for proc in done:
        assert proc.returncode == 0, f"{proc.args}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    worlds = sorted(line for proc in done for line in proc.stdout.splitlines() if line.startswith("world "))
    assert [line.split()[1:4] for line in worlds] == [["0", "2", scheduler], ["1", "2", scheduler]]
    final = torch.load(folder / "final.pt")
    expected = oracle(STEPS)
    assert final.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nodes", [1, 2], ids=["one-node", "two-nodes-compressed-list"])
def test_slurm_variables_on_two_processes_form_one_world(tmp_path: Path, nodes: int) -> None:
    port = free_port(20000, 40000)
    job = str(port - 20000)
    assert slurm_port(job) == port  # no MASTER_PORT: both tasks derive this one from the job id
    base = {
        "SLURM_JOB_ID": job,
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
    }
    envs = [{**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NODEID": "0"} for r in range(2)]
    if nodes == 2:  # one task on each of two 'nodes' (both loopback addresses): the master is the list's first
        base |= {"SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NODELIST": "127.0.0.[1-2]"}
        envs = [{**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": "0", "SLURM_NODEID": str(r)} for r in range(2)]
    argv = [sys.executable, WORKER, str(tmp_path), str(STEPS)]
    done = run_together([argv, argv], envs=envs, timeout_s=120)
    _check_one_world(done, tmp_path, "slurm")


@pytest.mark.parametrize(
    "flavour",
    [
        "openmpi",
        pytest.param("mpich", marks=pytest.mark.skipif(not LONG, reason="MULTIGPU_LONG=1: the second MPI flavour")),
    ],
)
def test_mpi_variables_on_two_processes_form_one_world(tmp_path: Path, flavour: str) -> None:
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    if flavour == "openmpi":
        envs = [
            {**base, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": str(r)}
            for r in range(2)
        ]
        envs = [{**env, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"} for env in envs]
    else:
        envs = [{**base, "PMI_RANK": str(r), "PMI_SIZE": "2"} for r in range(2)]
    argv = [sys.executable, WORKER, str(tmp_path), str(STEPS)]
    done = run_together([argv, argv], envs=envs, timeout_s=120)
    _check_one_world(done, tmp_path, flavour)


def test_two_launchers_under_pet_variables_form_one_world(tmp_path: Path) -> None:
    """As a PyTorchJob starts them: one ``multigpu launch`` per pod, told the nodes by ``PET_*`` only."""
    base = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    envs = [{**base, "PET_NODE_RANK": str(r)} for r in range(2)]
    argv = [sys.executable, "-m", "multigpu", "launch", "--strategy", "ddp", WORKER, str(tmp_path), str(STEPS)]
    done = run_together([argv, argv], envs=envs, timeout_s=150)
    _check_one_world(done, tmp_path, TORCHRUN)
