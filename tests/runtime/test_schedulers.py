"""Scheduler detection (runtime/schedulers.py): each scheduler's world, and inconsistent variables refused
by name. In-process: SLURM's lists are in tests/runtime/test_slurm_lists.py, hostile values of every
variable in tests/runtime/test_scheduler_variables.py, the multi-process starts in
tests/runtime/test_scheduler_starts.py."""

from __future__ import annotations

import os

import pytest
import torch

from multigpu.devices import get_device_type
from multigpu.errors import DeviceError, LaunchError
from multigpu.runtime.schedulers import (
    TORCHRUN,
    detect_worker,
    launcher_defaults,
    not_started_reason,
    slurm_port,
)
from multigpu.runtime.world import read_launch_env, scheduler_report

# -- each scheduler's world ----------------------------------------------------------------------------

_SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}


def test_slurm_task() -> None:
    world = detect_worker(_SLURM)
    assert world is not None
    assert (world.scheduler, world.global_rank, world.world_size, world.local_rank, world.local_world_size) == (
        "slurm",
        3,
        4,
        1,
        2,
    )
    assert (world.node_rank, world.master_addr, world.master_port) == (1, "gpu07", slurm_port("4242"))
    assert detect_worker({**_SLURM, "MASTER_PORT": "29600", "MASTER_ADDR": "10.0.0.1"}).master_port == 29600  # type: ignore[union-attr]
    env = read_launch_env(_SLURM)
    assert env is not None and env.scheduler == "slurm" and env.global_rank == 3


_STEP_OF_A_BIGGER_JOB = {  # 'srun --ntasks=2 --nodes=1' inside an allocation of 8 tasks on 2 nodes
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "3",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "8",
    "SLURM_NPROCS": "8",
    "SLURM_NNODES": "2",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_STEP_NODELIST": "gpu08",
}


def test_a_step_smaller_than_its_job_forms_the_steps_world() -> None:
    world = detect_worker(_STEP_OF_A_BIGGER_JOB)
    assert world is not None
    assert (world.global_rank, world.world_size, world.local_rank, world.local_world_size, world.node_rank) == (
        1,
        2,
        1,
        2,
        0,
    )
    assert world.master_addr == "gpu08"  # the step's first host, not the job's
    # the job's variables alone (no step variables): the job's world, never a mix of the two
    job_only = {k: v for k, v in _STEP_OF_A_BIGGER_JOB.items() if not k.startswith("SLURM_STEP_")}
    job_world = detect_worker({**job_only, "SLURM_STEP_ID": "0"})
    assert job_world is not None and (job_world.world_size, job_world.local_world_size) == (8, 4)
    assert job_world.master_addr == "gpu07"


def test_step_tasks_per_node_in_slurms_compressed_form() -> None:
    env = {
        **_STEP_OF_A_BIGGER_JOB,
        "SLURM_STEP_NUM_TASKS": "7",
        "SLURM_STEP_NUM_NODES": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "SLURM_STEP_NODELIST": "n[1-3],m9",
        "SLURM_PROCID": "6",
        "SLURM_NODEID": "3",
        "SLURM_LOCALID": "0",
    }
    world = detect_worker(env)
    assert world is not None and (world.world_size, world.local_world_size, world.node_rank) == (7, 1, 3)
    with pytest.raises(
        LaunchError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(x3\),1' names 4 nodes but SLURM_STEP_NUM_NODES=3"
    ):
        detect_worker({**env, "SLURM_STEP_NUM_NODES": "3"})


@pytest.mark.parametrize("step", ["batch", "extern", "interactive", "4294967294", "4294967295", "4294967291"])
def test_the_batch_and_extern_steps_are_not_srun_steps(step: str) -> None:
    """python run directly in the batch script (or the extern/interactive step) is no task of an srun step."""
    batch = {**_SLURM, "SLURM_STEP_ID": step, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    assert detect_worker(batch) is None
    assert "not started by srun" in (not_started_reason(batch) or "")
    assert launcher_defaults(batch) == (None, {})


def test_two_steps_of_one_job_derive_different_ports() -> None:
    first = detect_worker({**_STEP_OF_A_BIGGER_JOB, "SLURM_STEP_ID": "0"})
    second = detect_worker({**_STEP_OF_A_BIGGER_JOB, "SLURM_STEP_ID": "1"})
    assert first is not None and second is not None and first.master_port != second.master_port
    assert first.master_port == slurm_port("4242")  # step 0: the job's port, as before


def test_every_task_of_a_job_derives_the_same_port() -> None:
    ports = {slurm_port("987654") for _ in range(3)}
    assert len(ports) == 1 and 20000 <= ports.pop() < 40000
    assert slurm_port("123_4") == slurm_port("1234")  # array jobs


def test_torchrun_variables_come_first() -> None:
    env = read_launch_env({**_SLURM, "RANK": "0", "WORLD_SIZE": "2"})
    assert env is not None and env.scheduler == TORCHRUN and env.world_size == 2


def test_open_mpi_and_mpich() -> None:
    ompi = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_PORT": "29555",
    }
    world = detect_worker(ompi)
    assert world is not None and (world.scheduler, world.global_rank, world.master_addr, world.master_port) == (
        "openmpi",
        1,
        "127.0.0.1",
        29555,
    )
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h0"}
    world = detect_worker(mpich)
    assert world is not None and (world.scheduler, world.world_size, world.local_world_size) == ("mpich", 4, 2)


_OMPI_MAP_BY_NODE = {  # 'mpirun -np 4 --map-by node' on 2 nodes: ranks 0 and 2 on the first, 1 and 3 on the second
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "0",  # Open MPI's own: a local rank counted across jobs, no node index
    "MASTER_ADDR": "10.0.0.1",
}


def test_mpi_local_rank_comes_only_from_the_variables_that_mean_it() -> None:
    world = detect_worker(_OMPI_MAP_BY_NODE)
    assert world is not None and (world.local_rank, world.local_world_size) == (0, 2)
    assert world.node_rank is None  # rank // local size would say node 0: wrong under --map-by node
    cray = {"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2", "MASTER_ADDR": "h0"}
    world = detect_worker(cray)
    assert world is not None and (world.scheduler, world.local_rank, world.local_world_size) == ("mpich", 1, 2)
    one_node = detect_worker({"PMI_RANK": "1", "PMI_SIZE": "2"})  # no local variables, no MASTER_ADDR: this node
    assert one_node is not None and (one_node.local_rank, one_node.local_world_size, one_node.node_rank) == (1, 2, 0)


@pytest.mark.parametrize("addr", ["10.0.0.1", "node01"])
def test_mpi_without_local_variables_refuses_a_master_on_another_host(addr: str) -> None:
    with pytest.raises(LaunchError, match=rf"MASTER_ADDR={addr!r}.*MPI_LOCALRANKID and MPI_LOCALNRANKS"):
        detect_worker({"PMI_RANK": "1", "PMI_SIZE": "4", "MASTER_ADDR": addr})
    assert detect_worker({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "localhost"}) is not None


_MPIRUN_IN_SBATCH = {  # Open MPI's mpirun inside an sbatch job starts its daemons with srun: SLURM's are the daemon's
    **_SLURM,
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "gpu07",
}


def test_mpirun_inside_an_sbatch_job_takes_mpis_variables() -> None:
    world = detect_worker(_MPIRUN_IN_SBATCH)
    assert world is not None and (world.scheduler, world.global_rank, world.local_rank) == ("openmpi", 2, 0)
    # srun --mpi=pmi2 python train.py: PMI's rank is the task's own, and SLURM knows the local rank
    pmi2 = {**_SLURM, "PMI_RANK": "3", "PMI_SIZE": "4"}
    world = detect_worker(pmi2)
    assert world is not None and (world.scheduler, world.global_rank, world.local_rank) == ("slurm", 3, 1)


def test_multigpu_launch_under_mpirun_one_per_node() -> None:
    one_per_node = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29600",
    }
    assert launcher_defaults(one_per_node) == (
        "openmpi",
        {"nnodes": "2", "node-rank": "1", "master-addr": "10.0.0.1", "master-port": "29600"},
    )
    assert launcher_defaults({**_MPIRUN_IN_SBATCH, **one_per_node})[0] == "openmpi"  # MPI's win over SLURM's
    with pytest.raises(LaunchError, match=r"OMPI_COMM_WORLD_LOCAL_SIZE=2.*--map-by ppr:1:node"):
        launcher_defaults(_OMPI_MAP_BY_NODE)
    with pytest.raises(LaunchError, match=r"without MPI_LOCALRANKID and MPI_LOCALNRANKS.*--map-by ppr:1:node"):
        launcher_defaults({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "10.0.0.1"})
    with pytest.raises(LaunchError, match=r"MASTER_ADDR is not set.*-x MASTER_ADDR"):
        launcher_defaults({k: v for k, v in one_per_node.items() if k != "MASTER_ADDR"})
    alone = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert launcher_defaults(alone) == ("openmpi", {"nnodes": "1", "node-rank": "0"})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**_SLURM, "SLURM_PROCID": "4"}, r"SLURM_PROCID=4 lies outside SLURM_NTASKS=4"),
        (
            {**_SLURM, "SLURM_TASKS_PER_NODE": "3(x2)"},
            r"SLURM_TASKS_PER_NODE='3\(x2\)' adds up to 6 tasks but SLURM_NTASKS=4",
        ),
        ({**_SLURM, "SLURM_LOCALID": "2"}, r"SLURM_LOCALID=2 on SLURM_NODEID=1 does not fit"),
        ({**_SLURM, "SLURM_NTASKS": "four"}, r"SLURM_NTASKS='four' is not a count"),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, r"OMPI_COMM_WORLD_RANK=2 lies outside"),
        (
            {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
            r"MASTER_ADDR is not set",
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_PORT": "99999"}, r"MASTER_PORT='99999' is not a TCP port"),
    ],
)
def test_inconsistent_variables_are_refused_by_name(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        read_launch_env(env)


def test_a_process_started_by_hand_inside_an_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    batch_shell = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert detect_worker(batch_shell) is None  # not a task of an srun step: no world of 4 to wait for
    assert "expects SLURM_NTASKS=4 tasks, but it was not started by srun" in (not_started_reason(batch_shell) or "")
    for key in [k for k in os.environ if k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))]:
        monkeypatch.delenv(key)
    for key, value in batch_shell.items():
        monkeypatch.setenv(key, value)
    from multigpu.session import Session

    with pytest.raises(
        LaunchError, match=r"SLURM_NTASKS=4 tasks, but it was not started by srun.*srun --ntasks-per-node"
    ):
        Session(strategy="ddp").start()
    assert scheduler_report()["scheduler"].startswith("none: this process runs inside SLURM job 7")


def test_launcher_defaults() -> None:
    assert launcher_defaults({"PET_NNODES": "2", "PET_NODE_RANK": "1"}) == (
        TORCHRUN,
        {"nnodes": "2", "node-rank": "1"},
    )
    one_per_node = {**_SLURM, "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    one_per_node["SLURM_TASKS_PER_NODE"] = "1(x2)"
    scheduler, values = launcher_defaults(one_per_node)
    assert scheduler == "slurm"
    assert values == {"nnodes": "2", "node-rank": "1", "master-addr": "gpu07", "master-port": str(slurm_port("4242"))}
    with pytest.raises(LaunchError, match=r"SLURM_NTASKS=4 tasks on 2 node\(s\).*--ntasks-per-node=1"):
        launcher_defaults({**_SLURM, "SLURM_NNODES": "2"})
    assert launcher_defaults({}) == (None, {})
    # 'srun --nodes=2 --ntasks-per-node=1 multigpu launch' inside a job of 8 tasks: the step's counts decide
    one_launcher_per_node = {
        **_STEP_OF_A_BIGGER_JOB,
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
    }
    assert launcher_defaults(one_launcher_per_node)[1]["nnodes"] == "2"
    assert launcher_defaults(one_launcher_per_node)[1]["node-rank"] == "1"
    older_operator = {"PET_NNODES": "2", "MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456"}
    assert launcher_defaults(older_operator)[1] == {
        "nnodes": "2",
        "master-addr": "train-master-0",
        "master-port": "23456",
    }
    # a PyTorchJob's nprocPerNode may be a word, as torchrun reads it: one per GPU, one per core
    assert launcher_defaults({"PET_NPROC_PER_NODE": "gpu"})[1] == {"nproc-per-node": "auto"}
    assert launcher_defaults({"PET_NPROC_PER_NODE": "cpu"})[1] == {"nproc-per-node": str(os.cpu_count())}


_POD = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456"}


@pytest.mark.parametrize(
    "operator",
    [
        {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "1"},
        {"KUBERNETES_SERVICE_HOST": "10.96.0.1"},  # an operator that sets no PET_* at all
    ],
)
def test_a_pytorchjob_pod_started_directly_is_local_rank_0_of_1(
    monkeypatch: pytest.MonkeyPatch, operator: dict[str, str]
) -> None:
    """A PyTorchJob whose container runs ``python train.py``: one process per pod, no LOCAL_RANK."""
    env = read_launch_env({**_POD, **operator})
    assert env is not None
    assert (env.scheduler, env.global_rank, env.world_size, env.local_rank, env.local_world_size) == (
        "pytorchjob",
        1,
        2,
        0,
        1,
    )
    from multigpu.runtime import world

    cuda = get_device_type("cuda")
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(world, "process_device_type", lambda: cuda)  # a GPU machine's workers compute on CUDA
    assert world.process_device(env) == torch.device("cuda", 0)  # the pod's one GPU, not cuda:1
    # under torchrun (LOCAL_RANK set) nothing changes, nor for RANK/WORLD_SIZE outside a pod
    torchrun = read_launch_env({**_POD, **operator, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert torchrun is not None and (torchrun.scheduler, torchrun.local_rank) == (TORCHRUN, 1)
    plain = read_launch_env(_POD)
    assert plain is not None and (plain.scheduler, plain.local_rank, plain.local_world_size) == (TORCHRUN, 1, 2)


def test_a_pytorchjob_pod_expecting_several_processes_refuses_one_started_directly() -> None:
    with pytest.raises(LaunchError, match=r"PET_NPROC_PER_NODE='2'.*multigpu launch --strategy ddp"):
        read_launch_env({**_POD, "WORLD_SIZE": "4", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2"})


def test_multigpu_launch_in_an_old_operators_pod_takes_its_nodes_from_rank_and_world_size() -> None:
    """Operators before PET_*: each pod gets RANK (its index) and WORLD_SIZE (the pods), one launcher each."""
    pod = {**_POD, "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    assert launcher_defaults(pod) == (
        "pytorchjob",
        {"nnodes": "2", "node-rank": "1", "master-addr": "train-master-0", "master-port": "23456"},
    )
    assert launcher_defaults({**pod, "RANK": "0", "WORLD_SIZE": "1"}) == (
        "pytorchjob",
        {"nnodes": "1", "node-rank": "0"},
    )
    assert launcher_defaults(_POD) == (None, {})  # RANK/WORLD_SIZE outside a pod: not a PyTorchJob's


def test_a_task_bound_to_one_gpu_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``srun --gpus-per-task=1``: each task sees one GPU (index 0) whatever its SLURM_LOCALID."""
    from multigpu.runtime import world

    cuda = get_device_type("cuda")
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(world, "process_device_type", lambda: cuda)  # a GPU machine's workers compute on CUDA
    env = read_launch_env(_SLURM)
    assert env is not None and env.local_rank == 1
    assert world.process_device(env) == torch.device("cuda", 0)
    torchrun = read_launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert torchrun is not None
    with pytest.raises(DeviceError, match="2 processes per node were launched but this node sees 1 cuda"):
        world.process_device(torchrun)  # under torchrun one GPU for two processes stays an error


@pytest.mark.multiprocess  # collect_env asks the platform, which runs `uname`
def test_multigpu_env_says_which_scheduler_and_the_world(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from multigpu.cli.main import main

    for key in [k for k in os.environ if k.startswith(("SLURM_", "PET_", "OMPI_", "PMI_"))]:
        monkeypatch.delenv(key)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in _SLURM.items():
        monkeypatch.setenv(key, value)
    assert main(["env", "--json"]) == 0
    start = json.loads(capsys.readouterr().out)["start (scheduler)"]
    assert start["scheduler"] == "slurm"
    assert start["world"] == f"rank 3 of 4 (local rank 1 of 2), master gpu07:{slurm_port('4242')}"
    assert start["multigpu launch here"].startswith("refused: multigpu launch runs once per node")
    assert main(["env"]) == 0
    assert "start (scheduler):\n  scheduler: slurm\n  world: rank 3 of 4" in capsys.readouterr().out


def _only(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]) -> None:
    """This process's environment holds ``variables`` and none of any scheduler's or launcher's own."""
    prefixes = ("SLURM_", "PET_", "OMPI_", "PMI_", "MPI_", "KUBERNETES_", "MULTIGPU_")
    for key in [k for k in os.environ if k.startswith(prefixes)]:
        monkeypatch.delenv(key)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)


def test_multigpu_env_shows_each_start_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _only(monkeypatch, {**_POD, "KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    report = scheduler_report()
    assert (report["scheduler"], report["world"]) == (
        "pytorchjob",
        "rank 1 of 2 (local rank 0 of 1), master train-master-0:23456",
    )
    assert report["multigpu launch here"] == (
        "pytorchjob: --nnodes 2 --node-rank 1 --master-addr train-master-0 --master-port 23456"
    )
    _only(monkeypatch, _MPIRUN_IN_SBATCH)
    report = scheduler_report()
    assert (report["scheduler"], report["world"]) == ("openmpi", "rank 2 of 4 (local rank 0 of 2), master gpu07:29500")
    assert report["multigpu launch here"].startswith("refused: multigpu launch runs once per node")
    assert "--map-by ppr:1:node" in report["multigpu launch here"]
    _only(monkeypatch, {**_STEP_OF_A_BIGGER_JOB, "SLURM_STEP_ID": "batch"})
    assert scheduler_report()["scheduler"].startswith("none: this process runs inside SLURM job 4242")
    assert "SLURM_STEP_ID=batch, not an srun step" in scheduler_report()["scheduler"]
