"""Every subcommand's numeric flags refuse nan, inf, negatives, zero where meaningless and absurd sizes, with
the flag, the value and the range, exit code 2 and no traceback, before anything runs."""

from __future__ import annotations

import pytest

from multigpu.cli.main import build_parser, main
from multigpu.errors import ConfigError


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bandwidth", "--repeats", "0"], "argument --repeats: '0': pass a loop count, a whole number from 1 to 1000"),
        (["bandwidth", "--repeats", "-1"], "argument --repeats: '-1'"),
        (["bandwidth", "--timeout", "nan"], "argument --timeout: 'nan': pass a finite number of seconds > 0"),
        (["bandwidth", "--timeout", "inf"], "argument --timeout: 'inf'"),
        (["bandwidth", "--world-size", "0"], "argument --world-size: '0': pass a process count"),
        (["bandwidth", "--world-size", "10000"], "argument --world-size: '10000'"),
        (["bandwidth", "--factor", "1"], "argument --factor: '1': pass a size factor, a whole number >= 2"),
        (["demo", "--epochs", "0"], "argument --epochs: '0': pass an epoch count, a whole number from 1 to 10000"),
        (["demo", "--batch-size", "-3"], "argument --batch-size: '-3'"),
        (["demo", "--lr", "nan"], "argument --lr: 'nan': pass a learning rate, a finite number > 0 and <= 1000"),
        (["demo", "--lr", "-0.1"], "argument --lr: '-0.1'"),
        (["demo", "--seed", str(10**24)], "argument --seed: '1000000000000000000000000': pass a seed"),
        (["demo", "--ddp-processes", "abc"], "argument --ddp-processes: 'abc': pass a process count (0 skips"),
        (["demo", "--ddp-processes", "10000"], "argument --ddp-processes: '10000'"),
        (["ckpt", "inspect", "--max-keys", "-5", "x.pt"], "argument --max-keys: '-5': pass a key count"),
        (["advise", "--compute-ms", "nan"], "argument --compute-ms: 'nan': pass milliseconds, a finite number > 0"),
        (["advise", "--output-mb", "nan"], "argument --output-mb: 'nan'"),  # a ZeroDivisionError traceback before
        (["advise", "--activation-mb", "-1"], "argument --activation-mb: '-1': pass megabytes, a finite number >= 0"),
        (["advise", "--busbw", "inf"], "argument --busbw: 'inf': pass GB/s"),
        (["advise", "--gpu-mem-gb", "nan"], "argument --gpu-mem-gb: 'nan'"),
        (["advise", "--params", "-5"], "argument --params: '-5': pass a parameter count"),
        (["advise", "--overlap", "1.5"], "argument --overlap: '1.5': pass a share, a finite number >= 0 and <= 1"),
        (["advise", "--utilization", "0"], "argument --utilization: '0'"),
        (["advise", "--devices-per-node", "0"], "argument --devices-per-node: '0'"),
        (["advise", "--budget", "inf"], "argument --budget: 'inf': pass a finite number of seconds > 0"),
    ],
)
def test_absurd_numbers_are_refused_by_the_parser(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_advise_refuses_a_device_count_it_would_plan_for_minutes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["advise", "--model", "resnet50", "--gpu", "h100-80gb", "--link", "nvlink-h100", "--no-figure"]
    assert main([*argv, "--devices", "100000000"]) == 2
    printed = capsys.readouterr()
    assert "--devices 100000000: plan at most 65536 devices" in printed.out + printed.err


def test_the_library_below_the_flags_refuses_the_same() -> None:
    from multigpu.demo.train import TrainConfig
    from multigpu.profiling.bandwidth import message_sizes, time_per_op

    with pytest.raises(ConfigError, match=r"lr=nan must be a finite learning rate > 0"):
        TrainConfig(lr=float("nan"))
    with pytest.raises(ConfigError, match=r"seed=-1 must be from 0 to 2\*\*63 - 1"):
        TrainConfig(seed=-1)
    with pytest.raises(ConfigError, match=r"max size 1099511627776 bytes is above 64 GiB"):
        message_sizes(1024, 1 << 40)
    with pytest.raises(ConfigError, match=r"repeats=0: time at least one loop"):
        time_per_op(lambda: None, lambda: None, iters=1, repeats=0)  # min() of no loops before
