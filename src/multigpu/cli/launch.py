"""Run a training script under a strategy: one process, threads (dp), or one process per device (ddp, fsdp).

    multigpu launch --strategy ddp --nproc-per-node 2 examples/train.py --epochs 1
    multigpu launch --strategy fsdp --nproc-per-node 2 examples/train.py
    multigpu launch --strategy dp --devices cpu:2 examples/train.py
    multigpu launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py
    multigpu launch --strategy ddp --debug --log-dir logs --local-ranks-filter 0 train.py

For ddp and fsdp it builds torchrun's arguments and calls torch.distributed.run: one node binds to
127.0.0.1 on a free port, each process gets OMP_NUM_THREADS = cores / processes (unless set), and
a failing worker's rank and traceback are printed here. Inside the script,
``multigpu.session.Session(strategy="auto")`` picks up the strategy chosen here.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from multigpu.cli._launch_settings import mark_defaults, resolve
from multigpu.cli._numbers import count, seconds
from multigpu.core.limits import DAY_S, WEEK_S, parse_nnodes
from multigpu.errors import ConfigError, MultigpuError
from multigpu.strategies.registry import strategy_names

if TYPE_CHECKING:
    from multigpu.launcher.config import LaunchConfig

# torch and the launcher are imported when the command runs, so that building the parser stays
# cheap; the strategy names come from the strategies' registry, which lists them without importing
# torch (the parser asks when it is built, so a strategy registered before counts); at run time the
# launcher asks each strategy its facts (processes, --devices, launch environment)
LAUNCH_STRATEGIES = ("auto", *strategy_names())  # as registered when this module was imported

HELP = "run a training script under single, dp, ddp or fsdp (torchrun underneath for ddp and fsdp)"


def _nproc(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; pass e.g. 2 or 'auto'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} processes: pass a count >= 1 or 'auto'")
    return value


_STREAM_NAMES = ("none", "stdout", "stderr", "both")  # torchrun's --tee 0..3, by name


def _streams(text: str) -> str:
    if text.isdigit() and int(text) < len(_STREAM_NAMES):
        return _STREAM_NAMES[int(text)]
    if text not in _STREAM_NAMES:
        raise argparse.ArgumentTypeError(f"{text!r}: pass one of {', '.join(_STREAM_NAMES)} (or 0-3)")
    return text


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of local ranks; pass e.g. 0 or 0,1") from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"{text!r}: local ranks are >= 0; pass e.g. 0 or 0,1")
    return ranks


def _nnodes(text: str) -> str:
    try:
        parse_nnodes(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("nnodes=", "", 1)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strategy",
        default="auto",
        choices=("auto", *strategy_names()),
        help="ddp: one process per device (torchrun); fsdp: the same with parameters, gradients and optimizer "
        "state sharded; dp: one process, a replica per device in threads; "
        "single: one process, one device; auto: ddp for several processes, else single (default)",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=_nproc,
        default="auto",
        metavar="N|auto",
        help="ddp processes on this node: a count, or 'auto' = every GPU, else 2 on CPU (default)",
    )
    parser.add_argument(
        "--nnodes",
        type=_nnodes,
        default="1",
        metavar="N|MIN:MAX",
        help="number of nodes, or MIN:MAX for an elastic run (default 1)",
    )
    parser.add_argument(
        "--node-rank",
        type=count(0, None, "this node's rank"),
        default=0,
        metavar="R",
        help="this node's rank, 0..nnodes-1 (static rendezvous)",
    )
    parser.add_argument(
        "--master-addr",
        default=None,
        metavar="ADDR",
        help="rank 0's address; default 127.0.0.1 on one node, required for several nodes",
    )
    parser.add_argument(
        "--master-port",
        type=count(1, 65535, "a TCP port"),
        default=None,
        metavar="PORT",
        help="rank 0's port; default: a free port on one node (checked free when given)",
    )
    parser.add_argument(
        "--local-addr",
        default=None,
        metavar="ADDR",
        help="this node's address as the other nodes reach it (several nodes; default: its host name)",
    )
    parser.add_argument(
        "--collective-timeout",
        type=seconds(WEEK_S),
        default=None,
        metavar="SECONDS",
        help="how long a collective waits for a rank that stopped calling it before every rank fails "
        "with the likely cause (default 600)",
    )
    parser.add_argument(
        "--grace-period",
        type=seconds(DAY_S),
        default=30.0,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM/SIGHUP the launcher forwards the signal to every worker and kills those "
        "still running after this long (default 30)",
    )
    parser.add_argument(
        "--max-restarts",
        type=count(0, None, "a restart count"),
        default=0,
        metavar="K",
        help="restart all workers this often after a failure",
    )
    parser.add_argument(
        "--fault-tolerant",
        action="store_true",
        default=False,
        help="ddp in --replicas replica groups that survive each other: a dead group is restarted (up to "
        "--max-restarts times) and receives the current state live from a healthy one (torchft)",
    )
    parser.add_argument(
        "--replicas",
        type=count(2, None, "a replica group count"),
        default=None,
        metavar="R",
        help="replica groups of --nproc-per-node processes each (with --fault-tolerant, R >= 2)",
    )
    parser.add_argument(
        "--lighthouse",
        default=None,
        metavar="HOST:PORT",
        help="where the replica groups meet (several nodes: node 0's launcher starts it there; default: "
        "this launcher starts one on 127.0.0.1)",
    )
    parser.add_argument(
        "--rdzv-backend",
        default="static",
        choices=("static", "c10d"),
        help="static: fixed node ranks (default); c10d: elastic rendezvous at --rdzv-endpoint",
    )
    parser.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST:PORT", help="HOST:PORT of the c10d rendezvous (c10d backend)"
    )
    parser.add_argument(
        "--rdzv-id", default="multigpu", metavar="ID", help="run id shared by every node of an elastic run"
    )
    parser.add_argument(
        "--rdzv-conf", default="", metavar="K=V,...", help="extra rendezvous settings, e.g. join_timeout=600"
    )
    parser.add_argument(
        "--devices",
        default=None,
        metavar="SPEC",
        help="dp's devices, e.g. cpu:2 or cuda:0,1 (default: every GPU, else cpu:2)",
    )
    parser.add_argument(
        "--threads-per-process",
        type=count(1, None, "a thread count"),
        default=None,
        metavar="T",
        help="OMP_NUM_THREADS for each process (default: cores / processes, or your OMP_NUM_THREADS)",
    )
    parser.add_argument(
        "--no-bind-cores",
        dest="bind_cores",
        action="store_false",
        default=None,
        help="leave ddp workers unbound (default on a machine without GPUs: each worker runs on its own "
        "slice of the cores, about 6%% faster steps measured on 2 CPU workers)",
    )
    parser.add_argument(
        "--requeue",
        action="store_true",
        default=False,
        help="under SLURM: after a SIGTERM/SIGUSR1 stopped the run (workers saved and exited), requeue the "
        "job with 'scontrol requeue' (node rank 0's launcher)",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="read flags from a TOML file whose keys are the long flag names (nproc-per-node = 2); "
        "flags on the command line win",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="before every collective, check that all ranks issue the same one (operation, shapes, line) and "
        "name each rank's call on a mismatch; also sets TORCH_DISTRIBUTED_DEBUG (DETAIL under nccl, INFO under gloo; slower: for finding bugs)",
    )
    parser.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="write each rank's stdout and stderr to files in DIR (torchrun's layout: "
        "DIR/<run>/attempt_<k>/<local_rank>/stdout.log)",
    )
    parser.add_argument(
        "--tee",
        type=_streams,
        default=None,
        metavar="none|stdout|stderr|both",
        help="which streams also reach the console when they go to files (torchrun's --tee; 0-3 accepted; "
        "default both)",
    )
    parser.add_argument(
        "--local-ranks-filter",
        type=_ranks,
        default=None,
        metavar="R[,R...]",
        help="only these local ranks print on the console, e.g. 0 (the --log-dir files keep every rank)",
    )
    parser.add_argument("script", help="the training script (a .py file)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    mark_defaults(parser)  # last: command line > --config > scheduler (PET_*, SLURM) > default


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """The :class:`LaunchConfig` the command line describes (with --config and the scheduler's values)."""
    from multigpu.launcher.config import LaunchConfig

    args = resolve(args)
    return LaunchConfig(
        strategy=args.strategy,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        local_addr=args.local_addr,
        max_restarts=args.max_restarts,
        rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_conf=args.rdzv_conf,
        devices=args.devices,
        threads_per_process=args.threads_per_process,
        bind_cores=args.bind_cores,
        collective_timeout_s=args.collective_timeout,
        grace_period_s=args.grace_period,
        requeue=args.requeue,
        log_dir=args.log_dir,
        tee=args.tee,
        local_ranks_filter=args.local_ranks_filter,
        debug=args.debug,
        fault_tolerant=args.fault_tolerant,
        replicas=args.replicas,
        lighthouse=args.lighthouse,
    )


def run(args: argparse.Namespace) -> int:
    from multigpu.launcher.launch import launch

    try:
        return launch(config_from_args(args), args.script, args.script_args)
    except MultigpuError as exc:
        print(f"multigpu launch: {exc}", file=sys.stderr)
        return 2
