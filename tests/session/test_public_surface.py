"""The public names of multigpu.session and multigpu.distributed: changing them is a decision."""

from __future__ import annotations

import multigpu.distributed
import multigpu.session


def test_session_surface() -> None:
    assert sorted(multigpu.session.__all__) == [
        "DDPOptions",
        "FSDPOptions",
        "PRECISIONS",
        "Precision",
        "STRATEGIES",
        "Session",
        "SessionConfig",
        "Strategy",
        "build_precision",
        "build_strategy",
        "resolve_strategy_name",
    ]
    assert sorted(multigpu.session.STRATEGIES) == ["ddp", "dp", "fsdp", "single"]
    assert sorted(multigpu.session.PRECISIONS) == ["bf16", "fp16", "fp32"]


def test_distributed_surface() -> None:
    assert sorted(multigpu.distributed.__all__) == [
        "EpochLoader",
        "LaunchConfig",
        "LaunchEnv",
        "LaunchError",
        "ShardSpec",
        "barrier",
        "build_epoch_loader",
        "even_batches",
        "explain_collective_failures",
        "gather_by_index",
        "is_main_process",
        "launch",
        "read_launch_env",
        "reduce_value",
        "setup_process_group",
        "teardown_process_group",
    ]
