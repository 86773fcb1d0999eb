"""The schedulers as one priority tuple (runtime/schedulers.py's SCHEDULERS): each answers "am I here", "the
worker's world", "what multigpu launch should use" and "why I refuse" from the mapping it is given, and the
workers and the launcher walk the same order."""

from __future__ import annotations

import pytest

from multigpu.errors import LaunchError
from multigpu.runtime.schedulers import SCHEDULERS, Torchrun, detect_worker, launcher_defaults, not_started_reason
from multigpu.runtime.world import read_launch_env

_TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
_POD = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "train-master-0", "KUBERNETES_SERVICE_HOST": "k"}
_OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
_OMPI |= {"OMPI_COMM_WORLD_LOCAL_SIZE": "1", "MASTER_ADDR": "train-master-0"}
_MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2"}
_SRUN = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}
_SRUN |= {"SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_STEP_NODELIST": "n1"}


def test_the_one_order() -> None:
    assert [s.name for s in SCHEDULERS] == [Torchrun.name, "pytorchjob", "openmpi", "mpich", "slurm"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({**_SRUN, **_MPICH, **_OMPI, **_TORCHRUN}, Torchrun.name),  # torchrun's workers inherit mpirun's and srun's
        ({**_SRUN, **_OMPI, **_POD}, "pytorchjob"),
        ({**_SRUN, **_OMPI}, "openmpi"),  # mpirun inside an sbatch job
        ({**_SRUN, **_MPICH, "PMI_RANK": "0"}, "mpich"),
        ({**_SRUN, **_MPICH}, "slurm"),  # srun --mpi=pmi2: PMI_RANK is the task's SLURM_PROCID
        (_SRUN, "slurm"),
        ({}, None),
    ],
)
def test_each_scheduler_answers_am_i_here_in_the_one_order(env: dict[str, str], expected: str | None) -> None:
    found = detect_worker(env)
    assert (found.scheduler if found else None) == expected
    assert next((s.name for s in SCHEDULERS if s.detects(env)), None) == expected


def test_the_launcher_walks_the_workers_order() -> None:
    """A pod whose container runs mpirun: its RANK/WORLD_SIZE are the pods' for the workers, and now for the
    launcher too (it asked MPI first, in a second precedence of its own)."""
    env = {**_POD, **_OMPI}
    assert detect_worker(env).scheduler == "pytorchjob"  # type: ignore[union-attr]
    assert launcher_defaults(env) == (
        "pytorchjob",
        {"nnodes": "2", "node-rank": "1", "master-addr": "train-master-0", "master-port": "29500"},
    )
    assert launcher_defaults(_OMPI)[0] == "openmpi"
    assert launcher_defaults({**_POD, "PET_NNODES": "2", "PET_NODE_RANK": "1"})[0] == Torchrun.name


def test_the_answers_read_the_mapping_given_not_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**_SRUN, **_TORCHRUN, "SLURM_STEP_ID": "batch"}.items():
        monkeypatch.setenv(name, value)
    assert detect_worker({}) is None and launcher_defaults({}) == (None, {}) and not_started_reason({}) is None
    assert all(not s.detects({}) and s.launcher({}) is None and s.refusal({}) is None for s in SCHEDULERS)


def test_the_one_process_of_a_launch_reads_only_torchs_variables() -> None:
    """multigpu launch --strategy single|dp inside an srun step or under mpirun: the variables were its launcher's."""
    assert read_launch_env({**_SRUN, "MULTIGPU_STRATEGY": "dp"}) is None
    assert read_launch_env({**_OMPI, "MULTIGPU_STRATEGY": "single"}) is None
    assert detect_worker(_SRUN, launched_alone=True) is None
    pod = read_launch_env({**_POD, "MULTIGPU_STRATEGY": "dp"})
    assert pod is not None and pod.scheduler == "pytorchjob"


def test_why_a_scheduler_refuses() -> None:
    batch = {**_SRUN, "SLURM_STEP_ID": "batch"}
    assert detect_worker(batch) is None
    reason = not_started_reason(batch)
    assert reason is not None and "SLURM_NTASKS=2" in reason and "srun" in reason
    with pytest.raises(LaunchError, match=r"PET_NPROC_PER_NODE='2'.*multigpu launch --strategy ddp"):
        detect_worker({**_POD, "PET_NPROC_PER_NODE": "2"})
