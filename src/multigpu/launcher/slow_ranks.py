"""The slow rank in ``multigpu launch``'s end-of-run summary: what the main process left in the run folder.

The main process of a ddp/fsdp run reports a rank that sets the pace of the run on its stderr once
(:mod:`multigpu.runtime.stragglers`) and leaves the report in the run folder; after torchrun returns,
whether the run succeeded or failed, the launcher reads it back (as untrusted, through
:mod:`multigpu.core.run_files`) and repeats it last, where a long log's end is read.

Example::

    for line in summary_lines(failure_dir):
        print(line, file=sys.stderr)
"""

from __future__ import annotations

from pathlib import Path

from multigpu.core.run_files import UnreadableFile, entries, field, read_json
from multigpu.runtime.stragglers import RECORD_PATTERN, RankTimes, Verdict

_RECORD_BYTES = 1 << 20  # one verdict: a few numbers per rank


def summary_lines(folder: str | Path) -> list[str]:
    """One line per slow rank the main process reported (once per Session), by attempt; a garbled record is
    named, not read."""
    lines = []
    for path in entries(folder, RECORD_PATTERN):
        try:
            verdict = _verdict(read_json(path, limit=_RECORD_BYTES))
        except UnreadableFile as exc:
            lines.append(f"multigpu launch: the slow-rank record {path.name} was skipped: {exc}")
            continue
        attempt = path.stem.removeprefix("slow-rank-attempt-").split("-")[0]  # -<n>: the process's nth report
        lines.append(f"multigpu launch (attempt {attempt}): " + verdict.message().removeprefix("multigpu: "))
    return lines


def _verdict(data: object) -> Verdict:
    times = field(data, "times", list)
    rank = field(data, "rank", int)
    if not 2 <= len(times) <= 1 << 16 or not 0 <= rank < len(times):
        raise UnreadableFile(f"it names rank {rank} of {len(times)} ranks")
    per_rank = tuple(RankTimes(field(t, "compute_s", float), field(t, "data_wait_s", float)) for t in times)
    first, last = field(data, "first_step", int), field(data, "last_step", int)
    if not 1 <= first <= last:
        raise UnreadableFile(f"its steps {first}-{last} are no window")
    step_s = field(data, "step_s", float, default=0.0)
    return Verdict(first, last, per_rank, rank, field(data, "ratio", float), step_s)
