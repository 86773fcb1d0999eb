"""The launcher-to-worker codec: what one end writes the other reads back, and the environment is outside input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from multigpu.errors import ConfigError, LaunchError
from multigpu.runtime.worker_env import WorkerEnv, WorkerRank, owned_variable

_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1, max_size=40)
_SECONDS = st.floats(min_value=0, max_value=7 * 24 * 3600, exclude_min=True, allow_nan=False) | st.integers(1, 3600)

worker_envs = st.builds(
    WorkerEnv,
    strategy=st.none() | st.from_regex(r"[a-z][a-z0-9_-]{0,20}", fullmatch=True),
    devices=st.none() | _TEXT,
    threads=st.none() | st.integers(1, 999_999),
    bind_cores=st.booleans(),
    collective_timeout_s=st.none() | _SECONDS,
    failure_dir=st.none() | _TEXT.map(lambda text: "/" + text),
    stderr_copy=st.booleans(),
    debug=st.booleans(),
)


@given(worker_envs)
def test_what_the_launcher_writes_the_worker_reads_back(env: WorkerEnv) -> None:
    environ = env.to_environ()
    assert all(isinstance(v, str) and v for v in environ.values())
    assert WorkerEnv.from_environ(environ) == env
    # the worker also inherits the launcher's own environment: other variables change nothing
    assert WorkerEnv.from_environ({"PATH": "/bin", "RANK": "0", **environ}) == env


def test_a_plain_process_reads_the_defaults_and_unset_fields_are_not_written() -> None:
    assert WorkerEnv.from_environ({}) == WorkerEnv()
    assert WorkerEnv().to_environ() == {}
    assert WorkerEnv(failure_dir="/tmp/x").to_environ() == {"MULTIGPU_FAILURE_DIR": "/tmp/x"}


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "MULTIGPU_COLLECTIVE_TIMEOUT",
            "soon",
            r"MULTIGPU_COLLECTIVE_TIMEOUT='soon' is not a number of seconds.*--collective-timeout",
        ),
        ("MULTIGPU_COLLECTIVE_TIMEOUT", "inf", r"MULTIGPU_COLLECTIVE_TIMEOUT='inf'.*at most"),
        ("MULTIGPU_COLLECTIVE_TIMEOUT", "-3", r"MULTIGPU_COLLECTIVE_TIMEOUT='-3'"),
        ("MULTIGPU_COLLECTIVE_TIMEOUT", "1" * 5000, r"MULTIGPU_COLLECTIVE_TIMEOUT='1111.*\(5000 characters\)"),
        (
            "MULTIGPU_DEBUG",
            "true",
            r"MULTIGPU_DEBUG='true' is not 1 \(on\) or 0 \(off\); set it to 1 or 0, or unset it",
        ),
        ("MULTIGPU_BIND_CORES", "yes", r"MULTIGPU_BIND_CORES='yes' is not 1"),
        ("MULTIGPU_STDERR_COPY", " 1", r"MULTIGPU_STDERR_COPY=' 1' is not 1"),
        ("MULTIGPU_STRATEGY", "DDP; rm -rf", r"MULTIGPU_STRATEGY='DDP; rm -rf' is not a strategy's name.*--strategy"),
        (
            "MULTIGPU_FAILURE_DIR",
            "runs/failures",
            r"MULTIGPU_FAILURE_DIR='runs/failures' is not an absolute path.*unset it",
        ),
    ],
)
def test_a_malformed_variable_is_refused_by_name_with_the_fix(variable: str, value: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        WorkerEnv.from_environ({variable: value})


def test_openmps_own_thread_forms_are_left_to_openmp() -> None:
    assert WorkerEnv.from_environ({"OMP_NUM_THREADS": "4,2"}).threads is None
    assert WorkerEnv.from_environ({"OMP_NUM_THREADS": "9" * 400}).threads is None  # never int() of 400 digits
    assert WorkerEnv.from_environ({"OMP_NUM_THREADS": "004"}).threads == 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"threads": 0}, r"threads=0.*from 1"),
        ({"threads": True}, r"threads=True"),
        ({"debug": "yes"}, r"debug='yes'.*True or False"),
        ({"collective_timeout_s": "600"}, r"collective_timeout_s='600'.*number"),
        ({"collective_timeout_s": float("nan")}, r"MULTIGPU_COLLECTIVE_TIMEOUT='nan'"),
        ({"failure_dir": "relative"}, r"MULTIGPU_FAILURE_DIR='relative' is not an absolute path"),
        ({"devices": ""}, r"devices=''"),
        ({"strategy": "Not A Name"}, r"MULTIGPU_STRATEGY='Not A Name'"),
    ],
)
def test_a_worker_env_the_worker_would_misread_is_refused_when_built(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerEnv(**fields)  # type: ignore[arg-type]


def test_a_rank_is_written_as_torch_reads_it_and_an_impossible_one_is_refused() -> None:
    rank = WorkerRank(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=5)
    assert rank.to_environ() == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "5",
    }
    with pytest.raises(ConfigError, match="below their world sizes"):
        WorkerRank(rank=2, local_rank=0, world_size=2, local_world_size=2, master_addr="h", master_port=5)
    assert all(owned_variable(name) for name in {**rank.to_environ(), **WorkerEnv(debug=True).to_environ()})
    assert not owned_variable("NCCL_DEBUG")


def test_a_restarted_rank_says_how_often_and_the_worker_reads_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from multigpu.runtime import world

    place = {"rank": 0, "local_rank": 0, "world_size": 1, "local_world_size": 1, "master_addr": "h", "master_port": 5}
    assert "TORCHELASTIC_RESTART_COUNT" not in WorkerRank(**place).to_environ()  # a first start: torchrun's 0
    restarted = WorkerRank(**place, restarts=3).to_environ()
    for name, value in restarted.items():
        monkeypatch.setenv(name, value)
    assert world.restart_count() == 3
    with pytest.raises(ConfigError, match="below their world sizes"):
        WorkerRank(**place, restarts=-1)
