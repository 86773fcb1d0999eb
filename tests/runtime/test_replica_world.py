"""The fault-tolerant launch's variables, read in runtime/world.py: refused by name when they do not parse."""

from __future__ import annotations

import logging

import pytest

from multigpu.errors import LaunchError
from multigpu.runtime import world
from multigpu.runtime.replica_groups import NO_NCCL_RECORDER_NOTE


def test_replica_group_variables_are_read_and_bad_ones_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MULTIGPU_REPLICA_GROUP", raising=False)
    assert world.replica_group() is None
    monkeypatch.setenv("MULTIGPU_REPLICA_GROUP", "1")
    monkeypatch.setenv("MULTIGPU_REPLICA_GROUPS", "3")
    assert (world.replica_group(), world.replica_groups()) == (1, 3)
    monkeypatch.setenv("MULTIGPU_REPLICA_GROUP", "-1")
    with pytest.raises(LaunchError, match=r"MULTIGPU_REPLICA_GROUP.*-1.*--fault-tolerant --replicas R"):
        world.replica_group()
    monkeypatch.setenv("MULTIGPU_REPLICA_GROUP", "1")  # the codec reads every variable: one bad one at a time
    monkeypatch.setenv("MULTIGPU_REPLICA_GROUPS", "0")
    with pytest.raises(LaunchError, match=r"MULTIGPU_REPLICA_GROUPS.*not a count >= 1"):
        world.replica_groups()


def test_only_group_zeros_rank_zero_is_the_main_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MULTIGPU_REPLICA_GROUP", "1")
    assert not world.is_main_process()
    assert not world.require_launch_env("a test").is_main_process
    monkeypatch.setenv("MULTIGPU_REPLICA_GROUP", "0")
    assert world.is_main_process()


def test_torchfts_nccl_recorder_note_is_dropped_and_its_other_warnings_kept(caplog: pytest.LogCaptureFixture) -> None:
    """A gloo run has no NCCL flight recorder: torchft's note about it is noise; its other warnings are not."""
    logger = logging.getLogger("torchft.manager")
    logger.addFilter(NO_NCCL_RECORDER_NOTE)
    try:
        with caplog.at_level(logging.WARNING, logger="torchft.manager"):
            logger.warning("[g/0 - step 3] Unable to reset NCCL flight recorder recording so traces will be incorrect.")
            logger.warning("[g/0 - step 3] got exception in pg configure: peer gone")
    finally:
        logger.removeFilter(NO_NCCL_RECORDER_NOTE)
    assert [r.getMessage() for r in caplog.records] == ["[g/0 - step 3] got exception in pg configure: peer gone"]
