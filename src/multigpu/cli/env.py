"""Print what a bug report needs: versions, devices with memory, backends, environment variables.

multigpu env          # plain text, ready to paste into an issue
multigpu env --json   # the same as JSON
"""

from __future__ import annotations

import argparse
import json

HELP = "print versions (Python, torch, CUDA, NCCL), devices, backends and relevant env vars for a bug report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    from multigpu.profiling.environment import collect_env  # imports torch: only when the command runs

    report = collect_env()
    # plain print, not rich: the text must paste unchanged (no wrapping, no markup)
    print(json.dumps(report.sections, indent=2) if args.json else report.to_text())
    return 0
