"""Every scheduler variable the runtime reads, given hostile values (runtime/schedulers.py, mpi_env.py,
pet_env.py, scheduler_world.py, world.py): each ends, in well under a second, in a LaunchError naming the
variable, its value (cut short) and the fix, or in the right world; variables that contradict each other
are refused at once instead of waiting for a world that cannot form. In-process: pure functions of a mapping."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from multigpu.errors import LaunchError
from multigpu.runtime import world
from multigpu.runtime.schedulers import TORCHRUN, detect_worker, launcher_defaults, not_started_reason, slurm_port
from multigpu.runtime.world import read_launch_env

_SLURM = {  # a task of 'srun --nodes=2 --ntasks-per-node=2'
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_NNODES": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}
_STEP = {  # the same step as srun describes it (the job's variables are those of a bigger allocation)
    **_SLURM,
    "SLURM_NTASKS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}
_OMPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
}
_MPICH = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h0"}
_CRAY = {"PMI_RANK": "1", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2", "MASTER_ADDR": "h0"}
_TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h0"}
_POD = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m0", "PET_NNODES": "2", "PET_NODE_RANK": "1"}
_OLD_POD = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m0", "KUBERNETES_SERVICE_HOST": "k"}  # no PET_*
_PET = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "3"}

# (variable, the environment it is read from, what reads it)
_COUNTS: list[tuple[str, Mapping[str, str], Callable[[Mapping[str, str]], Any]]] = [
    *[(name, _SLURM, read_launch_env) for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS")],
    ("SLURM_NNODES", _SLURM, read_launch_env),
    ("SLURM_STEP_NUM_TASKS", _STEP, read_launch_env),
    ("SLURM_STEP_NUM_NODES", _STEP, read_launch_env),
    *[(name, _OMPI, read_launch_env) for name in _OMPI if name.startswith("OMPI_")],
    *[(name, _MPICH, read_launch_env) for name in ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")],
    *[(name, _CRAY, read_launch_env) for name in ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")],
    *[(name, _TORCHRUN, read_launch_env) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")],
    *[(name, _POD, read_launch_env) for name in ("RANK", "WORLD_SIZE")],
    *[(name, _OLD_POD, launcher_defaults) for name in ("RANK", "WORLD_SIZE")],
    *[(name, _PET, launcher_defaults) for name in _PET],
]
# not counts: a word, a sign, spaces, digits Python's int() reads but no scheduler writes, 5000 digits
_NOT_COUNTS = ["four", "-1", "+1", " 3", "3 ", "1_0", "٣", "²", "3.0", "0x3", "9" * 5000, "1" + "0" * 30]


def _refused_quickly(read: Callable[[Mapping[str, str]], Any], env: Mapping[str, str], pattern: str) -> None:
    start = time.perf_counter()
    with pytest.raises(LaunchError, match=pattern):
        read(env)
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize(("name", "env", "read"), _COUNTS, ids=[f"{n}-{r.__name__}" for n, _, r in _COUNTS])
@pytest.mark.parametrize("value", _NOT_COUNTS, ids=range(len(_NOT_COUNTS)))
def test_a_count_that_is_not_one_is_refused_by_name(
    name: str, env: Mapping[str, str], read: Callable[[Mapping[str, str]], Any], value: str
) -> None:
    shown = repr(value[:60])[:-1]  # a long value is cut short: its first characters
    _refused_quickly(read, {**env, name: value}, rf"{name}={_escape(shown)}.*(is not a count|is above 2147483647)")
    if len(value) > 60:
        _refused_quickly(read, {**env, name: value}, rf"\({len(value)} characters\)")


def _escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize(("name", "env", "read"), _COUNTS, ids=[f"{n}-{r.__name__}" for n, _, r in _COUNTS])
def test_each_base_environment_forms_its_world(
    name: str, env: Mapping[str, str], read: Callable[[Mapping[str, str]], Any]
) -> None:
    assert read(env) not in (None, (None, {}))  # the hostile values above are refused, not ignored


@pytest.mark.parametrize(
    "env",
    [_SLURM, _STEP, _OMPI, _MPICH, _TORCHRUN, {**_POD, "KUBERNETES_SERVICE_HOST": "k"}],
    ids=["slurm", "slurm-step", "openmpi", "mpich", "torchrun-variables", "pod"],
)
@pytest.mark.parametrize("port", ["0", "65536", "99999", "-1", "", " 80", "٣", "9" * 5000, "80.0"])
def test_a_master_port_that_is_not_one_is_refused(env: Mapping[str, str], port: str) -> None:
    _refused_quickly(read_launch_env, {**env, "MASTER_PORT": port}, r"MASTER_PORT=.* is not a TCP port.*1\.\.65535")
    found = read_launch_env({**env, "MASTER_PORT": "65535"})
    assert found is not None and found.master_port == 65535


@pytest.mark.parametrize(
    "env",
    [_SLURM, _OMPI, _MPICH, _TORCHRUN, {**_POD, "KUBERNETES_SERVICE_HOST": "k"}],
    ids=["slurm", "openmpi", "mpich", "torchrun-variables", "pod"],
)
@pytest.mark.parametrize("addr", ["", " ", "node 1", "nöde", "h\x00", "h\n", "x" * 300])
def test_a_master_address_that_is_not_one_is_refused(env: Mapping[str, str], addr: str) -> None:
    _refused_quickly(read_launch_env, {**env, "MASTER_ADDR": addr}, r"MASTER_ADDR=.* is not a host name.*rank 0's host")


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({**_PET, "PET_MASTER_PORT": "0"}, r"PET_MASTER_PORT='0' is not a TCP port"),
        ({**_PET, "MASTER_PORT": "70000"}, r"MASTER_PORT='70000' is not a TCP port"),
        ({**_PET, "PET_MASTER_ADDR": "a b"}, r"PET_MASTER_ADDR='a b' is not a host name"),
        ({**_PET, "MASTER_ADDR": "ünï"}, r"MASTER_ADDR='ünï' is not a host name"),
        ({**_PET, "PET_NNODES": "0"}, r"PET_NNODES='0' asks for no node.*MIN:MAX"),
        ({**_PET, "PET_NNODES": "4:2"}, r"PET_NNODES='4:2' asks for no node or a range that runs backwards"),
        ({**_PET, "PET_NNODES": "1:"}, r"PET_NNODES='1:' is not a count of nodes or MIN:MAX"),
        ({**_PET, "PET_NNODES": "1:2:3"}, r"PET_NNODES='1:2:3' is not a count of nodes or MIN:MAX"),
        (
            {**_PET, "PET_NODE_RANK": "2"},
            r"PET_NODE_RANK=2 lies outside PET_NNODES='2' nodes \(node ranks are 0\.\.1\)",
        ),
        ({**_PET, "PET_NNODES": "1:2", "PET_NODE_RANK": "2"}, r"PET_NODE_RANK=2 lies outside PET_NNODES='1:2'"),
        ({**_PET, "PET_NPROC_PER_NODE": "0"}, r"PET_NPROC_PER_NODE='0' starts no process.*auto, gpu, cpu"),
        ({**_PET, "PET_NPROC_PER_NODE": "many"}, r"PET_NPROC_PER_NODE='many' is not a count.*auto, gpu, cpu"),
        ({**_PET, "PET_RDZV_ENDPOINT": "h 1:29400"}, r"PET_RDZV_ENDPOINT='h 1:29400' holds spaces"),
        ({**_PET, "PET_RDZV_ID": "jöb"}, r"PET_RDZV_ID='jöb' holds spaces or non-ASCII"),
    ],
)
def test_pet_variables_that_cannot_form_a_world_are_refused(env: dict[str, str], pattern: str) -> None:
    fix = "" if "MASTER" in pattern else ".*PyTorchJob's spec"  # a master's fix: set it to one, on every process
    _refused_quickly(launcher_defaults, env, pattern + fix)


def test_pet_variables_that_can() -> None:
    assert launcher_defaults({**_PET, "PET_NNODES": "1:4", "PET_NODE_RANK": "3", "PET_NPROC_PER_NODE": "auto"}) == (
        TORCHRUN,
        {"nnodes": "1:4", "node-rank": "3", "nproc-per-node": "auto", "max-restarts": "3"},
    )
    assert launcher_defaults({"PET_NNODES": "", "PET_NODE_RANK": ""}) == (None, {})  # empty: unset, as torchrun


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        # the node count, the host list and the tasks per node must agree: else tasks wait for nodes that never come
        ({**_SLURM, "SLURM_NNODES": "3"}, r"SLURM_TASKS_PER_NODE='2\(x2\)' names 2 nodes but SLURM_NNODES=3"),
        ({**_SLURM, "SLURM_JOB_NODELIST": "gpu07"}, r"SLURM_JOB_NODELIST='gpu07' names 1 nodes but SLURM_NNODES=2"),
        (
            {**_SLURM, "SLURM_JOB_NODELIST": "node[1-100000000]"},
            r"SLURM_JOB_NODELIST='node\[1-100000000\]' names 100000000 nodes but SLURM_NNODES=2",
        ),
        (
            {k: v for k, v in _SLURM.items() if k != "SLURM_NNODES"} | {"SLURM_JOB_NODELIST": "a,b,c"},
            r"SLURM_JOB_NODELIST='a,b,c' names 3 nodes but SLURM_TASKS_PER_NODE='2\(x2\)' names 2",
        ),
        (
            {**_STEP, "SLURM_STEP_NODELIST": "gpu[07-09]"},
            r"SLURM_STEP_NODELIST='gpu\[07-09\]' names 3 nodes but SLURM_STEP_NUM_NODES=2",
        ),
        (
            {k: v for k, v in _SLURM.items() if k != "SLURM_TASKS_PER_NODE"},
            r"SLURM_NNODES names 2 nodes but SLURM_TASKS_PER_NODE is not set: how many of the SLURM_NTASKS=4",
        ),
        ({**_SLURM, "SLURM_NNODES": "0", "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": ""}, r"is empty"),
        ({**_SLURM, "SLURM_NODEID": "2"}, r"SLURM_LOCALID=1 on SLURM_NODEID=2 does not fit .* on 2 node\(s\)"),
        ({**_SLURM, "SLURM_NTASKS": "5"}, r"SLURM_TASKS_PER_NODE='2\(x2\)' adds up to 4 tasks but SLURM_NTASKS=5"),
        ({**_SLURM, "SLURM_TASKS_PER_NODE": "1(x99999999999999999999)"}, r"SLURM_TASKS_PER_NODE=.*a count above"),
        ({**_SLURM, "SLURM_JOB_NODELIST": "gpu[07-" + "9" * 5000 + "]"}, r"more than 18 digits"),
        ({**_SLURM, "SLURM_JOB_NODELIST": "gpu[07-08"}, r"unclosed"),
        ({**_SLURM, "SLURM_JOB_NODELIST": "gpu[08-07]"}, r"runs backwards"),
        (
            {**_OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
            r"OMPI_COMM_WORLD_LOCAL_RANK=2 and OMPI_COMM_WORLD_LOCAL_SIZE=2 do not fit",
        ),
        (
            {**_OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "5"},
            r"OMPI_COMM_WORLD_LOCAL_SIZE=5 do not fit OMPI_COMM_WORLD_SIZE=4",
        ),
        ({**_MPICH, "PMI_RANK": "4"}, r"PMI_RANK=4 lies outside PMI_SIZE=4"),
        ({**_MPICH, "PMI_SIZE": "0", "PMI_RANK": "0"}, r"PMI_RANK=0 lies outside PMI_SIZE=0"),
        ({**_TORCHRUN, "LOCAL_RANK": "2"}, r"LOCAL_RANK=2 and LOCAL_WORLD_SIZE=2 do not fit WORLD_SIZE=4"),
        ({**_TORCHRUN, "LOCAL_WORLD_SIZE": "8"}, r"LOCAL_WORLD_SIZE=8 do not fit WORLD_SIZE=4"),
        ({**_TORCHRUN, "RANK": "4"}, r"RANK=4 must lie in \[0, WORLD_SIZE=4\)"),
        ({**_POD, "PET_NODE_RANK": "0"}, r"RANK=1 must equal PET_NODE_RANK=0.*PyTorchJob's spec"),
        ({**_POD, "PET_NNODES": "3"}, r"WORLD_SIZE=2 must equal PET_NNODES=3"),
        # half of torch's world: run alone, each such process would be the main one (same checkpoint, same logs)
        ({"RANK": "1"}, r"RANK='1' is set but WORLD_SIZE is not: .*set WORLD_SIZE as well.*or unset RANK"),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "1"}, r"WORLD_SIZE='4' is set but RANK is not: .*set RANK as well"),
        # several nodes with no master: each node's ranks would wait for rank 0 on their own loopback
        (
            {k: v for k, v in _TORCHRUN.items() if k != "MASTER_ADDR"},
            r"WORLD_SIZE=4 processes with LOCAL_WORLD_SIZE=2 on this node run on several nodes, but MASTER_ADDR "
            r"is not set.*set MASTER_ADDR",
        ),
    ],
)
def test_variables_that_contradict_each_other_are_refused_at_once(env: dict[str, str], pattern: str) -> None:
    _refused_quickly(read_launch_env, env, pattern)


def test_half_of_torchs_world_that_says_one_process_or_that_a_scheduler_completes_is_no_error() -> None:
    assert read_launch_env({"RANK": "0"}) is None
    assert read_launch_env({"WORLD_SIZE": "1"}) is None
    one_node = {k: v for k, v in _TORCHRUN.items() if k not in ("MASTER_ADDR", "LOCAL_WORLD_SIZE")}
    assert read_launch_env(one_node).master_addr == "127.0.0.1"  # every rank on this node: loopback serves
    # an sbatch script that exports WORLD_SIZE for its srun tasks: SLURM's variables say each task's rank
    env = read_launch_env({**_SLURM, "WORLD_SIZE": "4"})
    assert env is not None and (env.scheduler, env.global_rank, env.world_size) == ("slurm", 3, 4)
    # the one process of 'multigpu launch --strategy single|dp', which inherited a WORLD_SIZE its launcher ignores
    assert read_launch_env({"WORLD_SIZE": "2", "MULTIGPU_STRATEGY": "single"}) is None


def test_the_mpi_launcher_refuses_a_rank_outside_its_launchers_or_node() -> None:
    one_per_node = {**_OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert launcher_defaults(one_per_node)[1]["node-rank"] == "1"
    _refused_quickly(
        launcher_defaults, {**one_per_node, "OMPI_COMM_WORLD_RANK": "4"}, r"RANK=4 lies outside .*=4 launchers"
    )
    bad_local = {**one_per_node, "OMPI_COMM_WORLD_LOCAL_RANK": "5"}  # a node's one launcher is its local rank 0
    _refused_quickly(
        launcher_defaults, bad_local, r"OMPI_COMM_WORLD_LOCAL_RANK=5 and OMPI_COMM_WORLD_LOCAL_SIZE=1 do not"
    )


def test_a_huge_world_forms_without_expanding_its_lists() -> None:
    huge = {
        **_SLURM,
        "SLURM_NTASKS": "100000000",
        "SLURM_NNODES": "100000000",
        "SLURM_TASKS_PER_NODE": "1(x100000000)",
        "SLURM_JOB_NODELIST": "node[1-100000000]",
        "SLURM_PROCID": "99999999",
        "SLURM_NODEID": "99999999",
        "SLURM_LOCALID": "0",
    }
    start = time.perf_counter()
    found = read_launch_env(huge)
    assert time.perf_counter() - start < 1
    assert found is not None and (found.global_rank, found.world_size, found.master_addr) == (99999999, 10**8, "node1")


def test_odd_job_and_step_ids_never_crash() -> None:
    big_job = {**_SLURM, "SLURM_JOB_ID": "9" * 5000}
    found = detect_worker(big_job)
    assert found is not None and found.master_port == slurm_port("9" * 5000) == slurm_port("999999999")
    assert detect_worker({**_SLURM, "SLURM_STEP_ID": "9" * 5000}) is None  # no normal step has such an id
    assert detect_worker({**_SLURM, "SLURM_STEP_ID": "²"}) is not None  # a step id SLURM does not write: still a step
    reason = not_started_reason({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "9" * 5000, "SLURM_STEP_ID": "batch"})
    assert reason is not None and "SLURM_NTASKS=99999999999999999999... tasks" in reason
    assert not_started_reason({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "²"}) is None


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-1", "0", "1e400", "9" * 5000, "٣"])
def test_a_collective_timeout_that_is_not_one_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MULTIGPU_COLLECTIVE_TIMEOUT", value)
    with pytest.raises(
        LaunchError, match=r"MULTIGPU_COLLECTIVE_TIMEOUT=.* is not a number of seconds.*--collective-timeout"
    ):
        world.collective_timeout_s()
    monkeypatch.setenv("MULTIGPU_COLLECTIVE_TIMEOUT", "12.5")
    assert world.collective_timeout_s() == 12.5
    monkeypatch.setenv("MULTIGPU_COLLECTIVE_TIMEOUT", "")
    assert world.collective_timeout_s() == world.DEFAULT_TIMEOUT_S


@pytest.mark.parametrize("value", ["²", "9" * 5000, "-1", "one"])
def test_a_restart_count_or_thread_count_that_is_not_one(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", value)
    with pytest.raises(LaunchError, match=r"TORCHELASTIC_RESTART_COUNT=.* is not a count|is above"):
        world.restart_count()
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert world.configured_threads() is None  # OpenMP's to read; multigpu picks its own count
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert world.configured_threads() == 4


@pytest.mark.multiprocess
def test_multigpu_env_answers_at_once_for_a_huge_node_list() -> None:
    """``multigpu env`` in a task whose job lists 100 million nodes: the first host is computed, not listed
    (it ran past 30 s expanding the list); a list that contradicts the node count is refused by name."""
    import sys

    from tests.launching import run_command

    huge = {
        **_SLURM,
        "SLURM_NTASKS": "100000000",
        "SLURM_NNODES": "100000000",
        "SLURM_TASKS_PER_NODE": "1(x100000000)",
        "SLURM_JOB_NODELIST": "node[1-100000000]",
        "SLURM_PROCID": "5",
        "SLURM_NODEID": "5",
        "SLURM_LOCALID": "0",
    }
    done = run_command([sys.executable, "-m", "multigpu", "env"], env=huge, timeout_s=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"world: rank 5 of 100000000 (local rank 0 of 1), master node1:{slurm_port('4242')}" in done.stdout
    contradicting = {**_SLURM, "SLURM_JOB_NODELIST": "node[1-100000000]"}
    done = run_command([sys.executable, "-m", "multigpu", "env"], env=contradicting, timeout_s=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: SLURM_JOB_NODELIST='node[1-100000000]' names 100000000 nodes but SLURM_NNODES=2" in done.stdout


@pytest.mark.multiprocess  # the stand-in scontrol runs once, for the job id that is one
@pytest.mark.parametrize("job", ["--help", "-v", "123 456", "٣", "9" * 5000], ids=range(5))
def test_requeue_never_hands_scontrol_a_value_that_is_no_job_id(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any, job: str
) -> None:
    """``--requeue`` passes SLURM_JOB_ID to ``scontrol requeue``: '--help' would be read as its option."""
    import os
    import signal

    from multigpu.launcher.launch import LaunchConfig
    from multigpu.launcher.preemption import maybe_requeue

    tool = tmp_path / "scontrol"
    tool.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "args"}\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", job)
    stopped = 128 + signal.SIGTERM
    assert maybe_requeue(LaunchConfig(requeue=True), stopped) == stopped
    assert not (tmp_path / "args").exists()
    err = capsys.readouterr().err
    assert "--requeue: SLURM_JOB_ID=" in err and "is not a SLURM job id" in err and "scontrol requeue <job id>" in err
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    assert maybe_requeue(LaunchConfig(requeue=True), stopped) == stopped
    assert (tmp_path / "args").read_text().split() == ["requeue", "31337"]
