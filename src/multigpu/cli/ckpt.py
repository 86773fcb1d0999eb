"""Inspect a checkpoint, or convert it between formats with clean keys.

    multigpu ckpt inspect runs/a                     # latest step of a Checkpointer folder
    multigpu ckpt inspect model.safetensors          # keys, shapes, dtypes, size, step, prefixes
    multigpu ckpt convert old.pt new.safetensors     # torch -> safetensors, module./_orig_mod. stripped
    multigpu ckpt convert a.safetensors a.pt --strip-prefix model.
    multigpu ckpt convert runs/a model.safetensors   # a sharded (fsdp, DCP) checkpoint -> one file

A sharded checkpoint (a Checkpointer's step folder under fsdp, or any torch.distributed.checkpoint
folder) is inspected from its index and converted into one file of whole tensors with the model's
keys. Files are read without executing code: a torch file that needs arbitrary unpickling is refused
unless --allow-unsafe-pickle is given (only for files you trust; the classes such a file needs are
imported from the current folder or PYTHONPATH, as in a script run from here). Inspect reads headers only;
convert refuses files whose tensors, made contiguous, would take more than --max-expansion
times the bytes on disk (a stride-0 view is a few bytes on disk and can be terabytes in memory),
and files whose keys differ only by wrapper prefixes (``module.w`` next to ``w``). Every
problem with a file is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import TYPE_CHECKING

from multigpu.cli._numbers import count
from multigpu.core.units import format_bytes
from multigpu.errors import MultigpuError

if TYPE_CHECKING:
    from rich.console import Console

    from multigpu.checkpoint.weights import Summary

# torch and the library are imported inside the command functions, so that building the parser
# stays cheap; the values the parser needs are written here (tests/cli/test_startup.py checks they
# match multigpu.checkpoint.formats.FORMATS and multigpu.checkpoint.formats.DEFAULT_MAX_EXPANSION)
FORMATS = ("safetensors", "torch")
DEFAULT_MAX_EXPANSION = 4.0

HELP = "inspect a checkpoint (keys, shapes, step, format) or convert it between formats"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = actions.add_parser(
        "inspect",
        help="list keys, shapes, dtypes, sizes, saved step, format and wrapper prefixes",
        description="Describe a weights file, a step-N checkpoint folder (sharded ones too), or a Checkpointer "
        "folder (its latest step).",
    )
    inspect.add_argument("path", help="weights file (.safetensors, .pt, ...), step folder, or checkpoint folder")
    inspect.add_argument(
        "--max-keys", type=count(0, None, "a key count"), default=40, help="tensors to list (0 lists all; default 40)"
    )
    _add_unsafe_flag(inspect)
    convert = actions.add_parser(
        "convert",
        help="rewrite a checkpoint's weights: strip wrapper prefixes, torch format <-> safetensors",
        description="Read IN's tensors, clean their keys, and write them atomically to OUT.",
    )
    convert.add_argument("input", metavar="IN", help="weights file, step folder, or checkpoint folder")
    convert.add_argument("output", metavar="OUT", help="file to write (format from its suffix unless --to)")
    convert.add_argument(
        "--to", choices=FORMATS, help="output format (default: .pt/.pth/.bin -> torch, else safetensors)"
    )
    convert.add_argument(
        "--keep-prefixes", action="store_true", help="keep module./_orig_mod. wrapper prefixes (default: strip them)"
    )
    convert.add_argument(
        "--strip-prefix",
        action="append",
        default=[],
        metavar="PREFIX",
        help="also remove this key prefix, e.g. 'model.' (repeatable)",
    )
    convert.add_argument(
        "--max-expansion",
        type=_expansion,
        default=DEFAULT_MAX_EXPANSION,
        metavar="FACTOR",
        help=f"refuse files whose tensors, made contiguous, exceed FACTOR x their size on disk "
        f"(default {DEFAULT_MAX_EXPANSION:g}; 'inf' for no limit)",
    )
    _add_unsafe_flag(convert)


def _expansion(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 1 (or 'inf')")
    return value


def _add_unsafe_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-unsafe-pickle",
        action="store_true",
        help="read torch files that need arbitrary unpickling; this can run code from the file: trusted files only",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text

    from multigpu.checkpoint.weights import summarize
    from multigpu.core.script import importable_from

    console = Console()
    # an unsafe pickle's classes (mymodels.Net) import from the current folder, as in a script run here
    classes_from_here = importable_from() if args.allow_unsafe_pickle else contextlib.nullcontext()
    try:
        with classes_from_here:
            if args.action == "inspect":
                summary = summarize(args.path, allow_unsafe_pickle=args.allow_unsafe_pickle)
                _print_summary(console, summary, args.max_keys)
            else:
                _convert(console, args)
    except MultigpuError as exc:
        Console(stderr=True, soft_wrap=True).print(Text.assemble(("error:", "bold red"), " ", _printable(str(exc))))
        return 1
    return 0


def _convert(console: Console, args: argparse.Namespace) -> None:
    from collections import Counter

    from rich.text import Text

    from multigpu.checkpoint.formats import write_tensors
    from multigpu.checkpoint.weights import read_weights, weights_file
    from multigpu.core.keys import clean_state_dict, collision_message, find_collisions, key_prefixes
    from multigpu.errors import CheckpointError

    prefixes = key_prefixes(args.strip_prefix, "--strip-prefix")  # 'model' removes 'model.', not 'model'
    source = weights_file(args.input)
    tensors, metadata = read_weights(
        source, allow_unsafe_pickle=args.allow_unsafe_pickle, max_expansion=args.max_expansion
    )
    if not args.keep_prefixes:
        tensors = clean_state_dict(tensors)
        collisions = find_collisions(tensors)
        if collisions:
            raise CheckpointError(
                collision_message(repr(str(source)), collisions) + " To write the keys unchanged, pass --keep-prefixes."
            )
    new_keys = [next((k[len(p) :] for p in prefixes if k.startswith(p)), k) for k in tensors]
    counts = Counter(new_keys)
    if len(counts) < len(new_keys):
        merged = sorted(new for new, n in counts.items() if n > 1)[:6]
        raise CheckpointError(f"--strip-prefix would merge keys of {str(source)!r} into {merged}; strip less.")
    tensors = type(tensors)(zip(new_keys, tensors.values()))
    written = write_tensors(tensors, args.output, format=args.to, metadata=metadata)
    console.print(Text(_printable(f"wrote {len(tensors)} tensors from {source} to {written}")))


def _print_summary(console: Console, summary: Summary, max_keys: int) -> None:
    from rich.table import Table
    from rich.text import Text

    facts = Table(show_header=False, box=None)
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")  # long paths wrap instead of being cut
    facts.add_row("file", Text(_printable(str(summary.path))))
    facts.add_row("format", _FORMAT_NAMES.get(summary.format, summary.format))
    facts.add_row("size on disk", format_bytes(summary.size_on_disk))
    facts.add_row("tensors", f"{len(summary.tensors)} ({format_bytes(summary.tensor_bytes)})")
    facts.add_row("saved step", "-" if summary.step is None else str(summary.step))
    prefixes = ", ".join(f"{p} ({n} keys)" for p, n in summary.prefixes.items())
    facts.add_row("wrapper prefixes", Text(prefixes or "none"))
    for name, value in summary.training_state.items():
        if name != "step":
            facts.add_row(name, Text(_printable(str(value))))
    console.print(facts)
    shown = summary.tensors if max_keys <= 0 else summary.tensors[:max_keys]
    table = Table(title="tensors")
    for column, justify in (("key", "left"), ("shape", "left"), ("dtype", "left"), ("size", "right")):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for t in shown:
        table.add_row(Text(_printable(t.key)), str(list(t.shape)), t.dtype, format_bytes(t.nbytes))
    if len(shown) < len(summary.tensors):
        table.caption = f"{len(summary.tensors) - len(shown)} more; --max-keys 0 lists all"
    console.print(table)


_FORMAT_NAMES = {"dcp": "dcp (torch.distributed.checkpoint, sharded)"}


def _printable(text: str) -> str:
    # Text from a file is shown, never interpreted: no rich markup, no terminal control characters.
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
