"""``multigpu launch --config run.toml``: keys are the long flags, the command line wins, the scheduler's
``PET_*`` / SLURM values come below the file, an unknown key names the nearest flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from multigpu.cli import launch as launch_cli
from multigpu.errors import ConfigError


def _config(argv: list[str]):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    launch_cli.add_arguments(parser)
    return launch_cli.config_from_args(parser.parse_args(argv))


@pytest.fixture(autouse=True)
def _no_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith(("PET_", "SLURM_"))]:
        monkeypatch.delenv(key)


def test_keys_are_long_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(
        'strategy = "ddp"\nnproc-per-node = 2\ngrace_period = 120\nno-bind-cores = true\n'
        "master-port = 29777\ncollective-timeout = 90\nrequeue = true\n"
    )
    config = _config(["--config", str(run), "t.py"])
    assert (config.strategy, config.nproc_per_node, config.grace_period_s) == ("ddp", 2, 120.0)
    assert (config.bind_cores, config.master_port, config.collective_timeout_s, config.requeue) == (
        False,
        29777,
        90.0,
        True,
    )
    config = _config(["--nproc-per-node", "1", "--grace-period", "5", "--config", str(run), "t.py"])
    assert (config.nproc_per_node, config.grace_period_s, config.strategy) == (1, 5.0, "ddp")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nproc-per-nod = 2\n", r"'nproc-per-nod' is not a flag of multigpu launch; did you mean 'nproc-per-node'\?"),
        ("grace = 3\n", r"'grace' is not a flag of multigpu launch; did you mean 'grace-period'\?"),
        ('strategy = "ddpp"\n', r"strategy = 'ddpp': --strategy takes one of auto, single, dp, ddp, fsdp"),
        ('nproc-per-node = "two"\n', r"--nproc-per-node refuses it \('two' is not a count"),
        ("no-bind-cores = 1\n", r"--no-bind-cores is a switch; write no-bind-cores = true"),
        ("master-port = [1]\n", r"--master-port takes one value"),
        ("strategy = \n", r"not valid TOML"),
        ('config = "other.toml"\n', r"'config' is not a flag of multigpu launch"),
    ],
)
def test_bad_files_name_the_key_and_the_fix(tmp_path: Path, text: str, message: str) -> None:
    run = tmp_path / "run.toml"
    run.write_text(text)
    with pytest.raises(ConfigError, match=message):
        _config(["--config", str(run), "t.py"])


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--config .*nope.toml: no such file"):
        _config(["--config", str(tmp_path / "nope.toml"), "t.py"])


def test_pet_variables_come_below_the_file_and_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "10.1.2.3",
        "PET_NPROC_PER_NODE": "4",
    }.items():
        monkeypatch.setenv(key, value)
    config = _config(["t.py"])
    assert (config.nnodes, config.node_rank, config.master_addr, config.nproc_per_node) == ("2", 1, "10.1.2.3", 4)
    run = tmp_path / "run.toml"
    run.write_text("nproc-per-node = 3\n")
    config = _config(["--config", str(run), "--node-rank", "0", "t.py"])
    assert (config.nproc_per_node, config.node_rank, config.nnodes) == (3, 0, "2")


def test_a_slurm_step_gives_nodes_node_rank_and_master(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = {
        "SLURM_JOB_ID": "5",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NODELIST": "gpu[3-4]",
    }
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    config = _config(["t.py"])
    assert (config.nnodes, config.node_rank, config.master_addr, config.master_port) == ("2", 1, "gpu3", 20005)


def test_the_help_names_the_new_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    launch_cli.add_arguments(parser)
    parser.print_help()
    text = capsys.readouterr().out
    assert "--config FILE.toml" in text and "--requeue" in text and "scontrol requeue" in text
    assert "(default 30)" in text  # the marked defaults still print as before
