"""Entry point of the ``multigpu`` command: parse, dispatch to one subcommand module, exit."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

import multigpu.cli as cli_package

_NOT_SUBCOMMANDS = {"main"}


def subcommands() -> dict[str, ModuleType]:
    """Every subcommand module in ``multigpu.cli``, by command name (``ckpt``, ``demo``, ...)."""
    found: dict[str, ModuleType] = {}
    for info in pkgutil.iter_modules(cli_package.__path__):
        if info.name.startswith("_") or info.name in _NOT_SUBCOMMANDS:
            continue
        found[info.name.replace("_", "-")] = importlib.import_module(f"multigpu.cli.{info.name}")
    return dict(sorted(found.items()))


class _VersionAction(argparse.Action):
    """``--version``: the installed package's version, looked up only when asked (importlib.metadata is slow to import)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        import multigpu

        print(f"multigpu {multigpu.__version__}")  # stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multigpu",
        description=(
            "Train one PyTorch model on several devices with data parallelism: threads "
            "(DataParallel) or processes (DDP), with measured memory, time and bandwidth."
        ),
        epilog="Run 'multigpu COMMAND --help' for the options of one command.",
    )
    parser.add_argument("--version", action=_VersionAction, help="print multigpu's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in subcommands().items():
        doc = (module.__doc__ or "").strip()
        child = sub.add_parser(
            name,
            help=module.HELP,
            description=doc or module.HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(child)
        child.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
