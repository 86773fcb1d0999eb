"""The public names of multigpu.session, multigpu.strategies, multigpu.runtime and multigpu.launcher:
changing them is a decision."""

from __future__ import annotations

import multigpu.launcher
import multigpu.runtime
import multigpu.session
import multigpu.strategies


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
    """The worker's side (runtime) and the parent's (launcher): together, what multigpu.runtime held."""
    assert sorted(multigpu.runtime.__all__ + multigpu.launcher.__all__) == [
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
        "launch_function",
        "read_launch_env",
        "reduce_value",
        "setup_process_group",
        "teardown_process_group",
    ]


def test_strategies_surface() -> None:
    assert sorted(multigpu.strategies.__all__) == [
        "DDPOptions",
        "FSDPOptions",
        "PRECISIONS",
        "Precision",
        "STRATEGIES",
        "Strategy",
        "build_precision",
        "build_strategy",
        "get_strategy",
        "multi_device_strategies",
        "process_strategies",
        "resolve_strategy_name",
        "strategy_labels",
    ]
    assert multigpu.session.STRATEGIES is multigpu.strategies.STRATEGIES
    assert sorted(multigpu.launcher.__all__) == ["LaunchConfig", "launch", "launch_function"]


def test_session_toolkit_methods() -> None:
    """The loop toolkit's names (Accelerate's, where one exists: docs/distributed.md has the table)."""
    from multigpu.session.toolkit import Toolkit

    assert sorted(name for name in vars(Toolkit) if not name.startswith("_")) == [
        "broadcast",
        "broadcast_object",
        "check_trigger",
        "gather",
        "gather_for_metrics",
        "gather_object",
        "is_local_main_process",
        "join",
        "local_main_process_first",
        "main_process_first",
        "pad_across_processes",
        "set_trigger",
        "skip_first_batches",
        "split_between_processes",
    ]
