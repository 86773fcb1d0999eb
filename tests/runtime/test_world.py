"""Launch environment and process group, with a real one-rank gloo group on loopback."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from multigpu.errors import ConfigError, DeviceError
from multigpu.runtime import collectives, world
from multigpu.runtime.world import LaunchEnv, LaunchError


def test_read_launch_env_parses_torchrun_variables() -> None:
    env = world.read_launch_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
        }
    )
    assert env == LaunchEnv(
        global_rank=3, local_rank=1, world_size=4, local_world_size=2, master_addr="10.0.0.1", master_port=1234
    )
    assert not env.is_main_process
    assert world.read_launch_env({}) is None


def test_inconsistent_launch_variables_are_an_error() -> None:
    with pytest.raises(LaunchError, match=r"RANK=2 must lie in \[0, WORLD_SIZE=2\)"):
        world.read_launch_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(LaunchError, match=r"RANK=.zero. is not a count or index.*multigpu launch"):
        world.read_launch_env({"RANK": "zero", "WORLD_SIZE": "2"})


def test_require_launch_env_outside_a_launch_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(LaunchError, match=r"training needs a launched process.*multigpu launch"):
        world.require_launch_env("training")


def test_backend_is_nccl_on_cuda_and_gloo_elsewhere() -> None:
    assert world.choose_backend("cuda") == "nccl"
    assert world.choose_backend("cpu") == "gloo"


def test_more_processes_than_gpus_names_the_right_count() -> None:
    world.check_world_matches_devices(4, "cpu", 1)  # CPU processes share the CPU: any count
    world.check_world_matches_devices(2, "cuda", 2)
    with pytest.raises(
        DeviceError, match=r"4 processes per node were launched but this node sees 2 cuda.*--nproc-per-node 2"
    ):
        world.check_world_matches_devices(4, "cuda", 2)


def test_process_group_setup_collectives_and_teardown(one_rank_group: None) -> None:
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert world.is_main_process()
    collectives.barrier()
    assert float(collectives.reduce_value(torch.tensor(3.0), "sum")) == 3.0
    got = collectives.gather_by_index(torch.tensor([[1.0], [2.0]]), torch.tensor([1, 0]), 2)
    torch.testing.assert_close(got, torch.tensor([[2.0], [1.0]]))
    world.teardown_process_group()
    assert not dist.is_initialized()
    world.teardown_process_group()  # twice is fine


def test_collectives_outside_a_group_return_the_local_answer() -> None:
    assert float(collectives.reduce_value(2.0, "max")) == 2.0
    torch.testing.assert_close(
        collectives.gather_by_index(torch.tensor([5.0, 6.0, 7.0]), torch.tensor([2, 0, 1]), 3),
        torch.tensor([6.0, 7.0, 5.0]),
    )


def test_collective_bad_input_names_the_fix() -> None:
    with pytest.raises(
        ConfigError, match=r"op='median' is not a reduction; use one of \['max', 'mean', 'min', 'sum'\]"
    ):
        collectives.reduce_value(1.0, "median")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="values has 2 rows but indices has 1"):
        collectives.gather_by_index(torch.zeros(2), torch.tensor([0]), 2)
    with pytest.raises(ConfigError, match=r"no rank produced results for dataset indices \[2\]"):
        collectives.gather_by_index(torch.zeros(2), torch.tensor([0, 1]), 3)
    # a negative index wrapped around and overwrote the last sample's result (and "covered" it)
    with pytest.raises(ConfigError, match=r"rank 0 passed dataset indices \[-1\] outside \[0, 2\); pass each"):
        collectives.gather_by_index(torch.tensor([5.0, 6.0]), torch.tensor([0, -1]), 2)


def test_rank_world_size_and_main_process_have_one_answer_before_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launched process is the rank its launcher gave it even before it joins the group."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not world.in_process_group()
    assert (world.global_rank(), world.world_size(), world.is_main_process()) == (1, 2, False)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (world.global_rank(), world.world_size(), world.is_main_process()) == (0, 1, True)


def test_inside_a_group_the_group_answers_for_everyone(one_rank_group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from multigpu.profiling.ddp import DDPProfiler
    from multigpu.runtime.collective_failures import _where

    assert world.in_process_group()
    assert (world.global_rank(), world.world_size(), world.is_main_process()) == (0, 1, True)
    assert _where() == "rank 0 of world_size 1"  # the failure messages ask the runtime
    profiler = DDPProfiler(DistributedDataParallel(torch.nn.Linear(2, 2)))
    assert profiler.rank_profile().rank == 0 and profiler.gather().backend == "gloo"


def test_the_collective_timeout_variable_is_read_finite_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MULTIGPU_COLLECTIVE_TIMEOUT", raising=False)
    assert world.collective_timeout_s() == world.DEFAULT_TIMEOUT_S
    monkeypatch.setenv("MULTIGPU_COLLECTIVE_TIMEOUT", "90.5")
    assert world.collective_timeout_s() == 90.5
    for value in ("inf", "nan", "-1", "0", "1e300", "abc"):  # inf overflowed torch's timer in every worker
        monkeypatch.setenv("MULTIGPU_COLLECTIVE_TIMEOUT", value)
        with pytest.raises(
            LaunchError, match=r"MULTIGPU_COLLECTIVE_TIMEOUT=.*not a number of seconds > 0 and at most 604800"
        ):
            world.collective_timeout_s()
