"""The step profiler's data-wait phase: the time a step waits for its next DataLoader batch."""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

from multigpu.profiling.data_wait import DATA_WAIT
from multigpu.profiling.records import OTHER
from multigpu.profiling.step import ProfileConfig, profile_steps

_SLEEP_S = 0.005  # per sample; 4 samples per batch: 20 ms per batch


class SlowSamples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(_SLEEP_S)
        return torch.full((4,), float(index)), torch.tensor(index % 2)


def test_a_loader_that_sleeps_20_ms_per_batch_shows_about_20_ms_of_data_wait() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    original = _BaseDataLoaderIter.__next__
    with profile_steps(optimizer=optimizer, config=ProfileConfig(warmup=1)) as profiler:
        for x, y in DataLoader(SlowSamples(), batch_size=4):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    profile = profiler.profile()
    assert _BaseDataLoaderIter.__next__ is original  # put back after the block
    device = profile.devices[0]
    waited = profile.median_seconds(DATA_WAIT, device)
    assert 4 * _SLEEP_S <= waited < 10 * 4 * _SLEEP_S, waited  # at least the sleeps; loaded machines add some
    # its own phase, inside each step's wall time, and no longer counted in "other"
    assert DATA_WAIT in profile.phase_names() and OTHER not in profile.phase_names()
    assert len(profile.steps) == 7 and all(0 < s.seconds(DATA_WAIT, device) <= s.wall_s for s in profile.steps)
    assert profile.median_other_s(device) <= profile.median_step_s() - waited + 1e-9
