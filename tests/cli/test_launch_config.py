"""``multigpu launch --config run.toml``: keys are the long flags, the command line wins, the scheduler's
``PET_*`` / SLURM values come below the file, an unknown key names the nearest flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from multigpu.cli import launch as launch_cli
from multigpu.errors import ConfigError, LaunchError


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


def _config_error(text: bytes | str, tmp_path: Path, argv: list[str] | None = None) -> str:
    run = tmp_path / "run.toml"
    run.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as caught:
        _config(["--config", str(run), *(argv or []), "t.py"])
    return str(caught.value)


def test_a_file_that_is_not_utf8_or_nests_too_deep_is_named(tmp_path: Path) -> None:
    message = _config_error(b'strategy = "d\xffp"\n', tmp_path)
    assert message.startswith(f"--config {tmp_path / 'run.toml'}: not UTF-8 text (byte 0xff at offset 13)")
    assert "save it as UTF-8" in message
    deep = "nproc-per-node = " + "[" * 5000 + "]" * 5000 + "\n"
    assert "nested too deep for the TOML parser" in _config_error(deep, tmp_path)
    assert "larger than 1048576 bytes" in _config_error(b"# " + b"x" * (1 << 20) + b"\n", tmp_path)
    with pytest.raises(ConfigError, match=r"--config .*: not a regular file"):
        _config(["--config", str(tmp_path), "t.py"])


def test_an_empty_config_path_is_refused_not_skipped() -> None:
    with pytest.raises(ConfigError, match=r"--config '' is empty; pass the path of a TOML file"):
        _config(["--config", "", "t.py"])


def test_one_flag_in_both_spellings_is_refused_naming_both(tmp_path: Path) -> None:
    message = _config_error("nproc-per-node = 2\nnproc_per_node = 4\n", tmp_path)
    assert "'nproc-per-node' and 'nproc_per_node' both set --nproc-per-node; keep one of the two spellings" in message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "collective-timeout = inf\n",
            r"collective-timeout = inf: --collective-timeout refuses it \('inf': pass a finite",
        ),
        ("collective-timeout = nan\n", r"--collective-timeout refuses it \('nan'"),
        ("collective-timeout = -1\n", r"--collective-timeout refuses it \('-1'"),
        ("collective-timeout = 1e12\n", r"at most 604800 \(7 days\)"),
        ("grace-period = 1e300\n", r"--grace-period refuses it .*at most 86400 \(1 day\)"),
        ('nnodes = "abc"\n', r"--nnodes refuses it \('abc': pass a node count >= 1 .* or MIN:MAX"),
        ('nnodes = "4:2"\n', r"--nnodes refuses it \('4:2'"),
        ("nnodes = 0\n", r"--nnodes refuses it \('0'"),
        ("node-rank = -1\n", r"--node-rank refuses it \('-1': pass this node's rank, a whole number >= 0\)"),
        ("max-restarts = -2\n", r"--max-restarts refuses it"),
        ("master-port = 0\n", r"--master-port refuses it \('0': pass a TCP port, a whole number from 1 to 65535\)"),
        ("threads-per-process = 0\n", r"--threads-per-process refuses it"),
        ("grace-period = true\n", r"--grace-period takes one value"),
    ],
)
def test_absurd_values_in_the_file_are_refused_by_key(tmp_path: Path, text: str, message: str) -> None:
    import re

    assert re.search(message, _config_error(text, tmp_path))


def test_values_that_depend_on_others_are_refused_by_the_config(tmp_path: Path) -> None:
    assert "node_rank=2 with nnodes='2': pass this node's rank, 0..1" in _config_error(
        'nnodes = "2"\nnode-rank = 2\nmaster-addr = "10.0.0.1"\n', tmp_path
    )
    assert "threads_per_process=100000: pass a thread count from 1 to" in _config_error(
        "threads-per-process = 100000\n", tmp_path
    )


def test_a_pet_variable_that_torchrun_would_choke_on_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # the runtime reads PET_* (runtime/pet_env.py) and refuses it by name before the flag's own check sees it
    for value in ("abc", "1:2:3", "2:", ":2", "0", "3:1"):
        monkeypatch.setenv("PET_NNODES", value)
        with pytest.raises(LaunchError, match=rf"PET_NNODES='{value}' .*MIN:MAX.*PyTorchJob's spec"):
            _config(["t.py"])
