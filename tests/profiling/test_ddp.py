"""DDP profile over two real gloo processes: bytes reduced, step count, and a named straggler."""

from __future__ import annotations

import gc
import statistics
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multigpu.errors import ConfigError
from multigpu.profiling.ddp import DDPProfile, RankProfile, _union_length, profile_ddp
from multigpu.report.folder import write_ddp_report
from tests.conftest import free_port

STEPS, WARMUP, SLOW_RANK, DELAY_S = 4, 1, 1, 0.08


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def _worker(rank: int, world_size: int, port: int, out: str, device_type: str) -> None:
    """One DDP rank (gloo on CPU with a slow rank, nccl on CUDA); rank 0 writes the gathered profile."""
    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        model = DistributedDataParallel(_net().to(device), device_ids=[rank] if device_type == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(16, 32, device=device), torch.randint(0, 4, (16,), device=device)
        with profile_ddp(model, optimizer=opt, warmup=WARMUP) as prof:
            for _ in range(WARMUP + STEPS):
                if rank == SLOW_RANK and device_type == "cpu":
                    time.sleep(DELAY_S)  # this rank computes slower: the other one waits in the all-reduce
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        profile = prof.gather()
        if rank == 0:
            Path(out).write_text(profile.to_json())
        dist.barrier()
        # Free DDP's reducer (it holds the process group and the comm hook) before the group goes:
        # tearing the group down under a live reducer can abort the process at exit.
        del model, prof, opt
        gc.collect()
    finally:
        dist.destroy_process_group()


def _profile_of_workers(out: Path, world_size: int, device_type: str, limit_s: float) -> DDPProfile:
    """Run :func:`_worker` on ``world_size`` spawned processes (killed after ``limit_s``); rank 0's profile."""
    args = (world_size, free_port(), str(out), device_type)
    context = mp.start_processes(_worker, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + limit_s
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{device_type} DDP workers did not finish in {limit_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return DDPProfile.from_json(out.read_text())


@pytest.fixture(scope="module")
def ddp_profile(tmp_path_factory: pytest.TempPathFactory) -> DDPProfile:
    return _profile_of_workers(tmp_path_factory.mktemp("ddp") / "profile.json", 2, "cpu", limit_s=90)


@pytest.mark.multiprocess
def test_bytes_reduced_equal_gradient_bytes_every_step(ddp_profile: DDPProfile) -> None:
    grad_bytes = sum(p.numel() * p.element_size() for p in _net().parameters())
    assert [r.rank for r in ddp_profile.ranks] == [0, 1]
    for rank in ddp_profile.ranks:
        assert len(rank.step_s) == STEPS
        assert rank.allreduce_bytes == [grad_bytes] * STEPS
        assert all(0 < a <= s for a, s in zip(rank.allreduce_s, rank.step_s))


@pytest.mark.multiprocess
def test_slow_rank_is_named_and_the_other_waits_in_all_reduce(ddp_profile: DDPProfile) -> None:
    straggler = ddp_profile.straggler()
    assert straggler.rank == SLOW_RANK and straggler.is_straggler
    assert f"rank {SLOW_RANK}" in straggler.describe()
    fast = ddp_profile.ranks[1 - SLOW_RANK]
    # the fast rank spends most of the injected delay waiting inside the all-reduce (median: the
    # second step's forward also waits, in DDP's one-time bucket rebuild)
    assert statistics.median(fast.allreduce_s) > 0.5 * DELAY_S
    assert ddp_profile.ranks[SLOW_RANK].busy_s() > DELAY_S


@pytest.mark.multiprocess
def test_ddp_report_renders(ddp_profile: DDPProfile, tmp_path: Path) -> None:
    console = Console(record=True, width=140)
    files = write_ddp_report(tmp_path, ddp_profile, console=console)
    assert f"straggler: rank {SLOW_RANK}" in console.export_text()
    assert DDPProfile.from_json(files[0].read_text()) == ddp_profile
    assert files[1].name == "ddp.png" and files[1].stat().st_size > 1000


def test_union_counts_overlapping_buckets_once() -> None:
    assert _union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)


def test_profile_ddp_rejects_a_plain_module() -> None:
    with pytest.raises(ConfigError, match="needs a DistributedDataParallel model, got Linear"):
        with profile_ddp(nn.Linear(2, 2)):  # type: ignore[arg-type]
            pass


def test_straggler_threshold_below_one_is_rejected() -> None:
    profile = DDPProfile(backend="gloo", ranks=[RankProfile(0, [1.0], [0.5], [4], [1])])
    with pytest.raises(ConfigError, match=r"threshold=0.5 must be >= 1.0"):
        profile.straggler(threshold=0.5)


@pytest.mark.cuda
@pytest.mark.multiprocess
def test_ddp_profile_on_cuda_with_nccl_uses_events(tmp_path: Path) -> None:
    world_size = min(2, torch.cuda.device_count())
    profile = _profile_of_workers(tmp_path / "profile.json", world_size, "cuda", limit_s=120)
    grad_bytes = sum(p.numel() * p.element_size() for p in _net().parameters())
    assert profile.backend == "nccl" and len(profile.ranks) == world_size
    for rank in profile.ranks:
        assert rank.allreduce_bytes == [grad_bytes] * STEPS
        assert all(0 < a <= s for a, s in zip(rank.allreduce_s, rank.step_s))
