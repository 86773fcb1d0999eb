"""What the workers left behind when a run failed, and what it proves: who never arrived, where, why.

:func:`read` collects, after torchrun returned, what each worker of this node wrote for the launcher:
its ledger of collectives and its stacks (:mod:`multigpu.runtime.tracking`) and the end of its stderr
(torchrun's log files, :func:`multigpu.launcher.torchrun.log_args`). :mod:`multigpu.launcher.root_cause`
asks it two questions:

- :meth:`Evidence.hang` -- did a collective time out because some rank never reached it? The ranks'
  ledgers are compared: the ranks whose count of collectives is behind the highest are the ones that never
  arrived; their stack (dumped on request by a rank that timed out, before the launcher stopped them)
  shows where they were. The ranks that timed out are consequences.
- :meth:`Evidence.abort_text` -- what did a worker that died by a signal (gloo's or NCCL's abort on a
  mismatched collective) print from C++ before it died, and on which line of the script was it?

Example::

    found = read(failure_dir, attempt=0, log_dir=log_dir)
    hang = found.hang(failures)     # None unless a collective timed out waiting for a rank
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from multigpu.core.run_files import UnreadableFile, entries, modified_ns, read_bytes
from multigpu.runtime.tracking import Entry, read_ledgers, read_snapshot, read_stack, stderr_copy_path

# the docs section a summary points to (tests/test_docs.py checks the heading exists)
GUIDE = "docs/distributed.md, section 'When a run hangs or a collective fails'"

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>[0-9]{1,9}) in (?P<func>.+)$')
_ABORT = re.compile(
    r"what\(\):|collective mismatch|enforce fail|terminate called|NCCL (?:error|WARN)|ncclInvalidUsage"
    r"|Fatal Python error",
    re.IGNORECASE,
)
_LIBRARY = ("site-packages", "dist-packages", "<frozen", "/multigpu/")
_KEEP = 16_000  # bytes of a rank's stderr kept: its last words


@dataclass(frozen=True, kw_only=True)
class Frame:
    """One frame of a stack: ``file:line in function``."""

    file: str
    line: int
    function: str

    @property
    def is_user(self) -> bool:
        """In the user's code (not the standard library's runpy, torch, or multigpu)."""
        return not any(part in self.file for part in _LIBRARY) and "/lib/python" not in self.file

    def __str__(self) -> str:
        return f"{Path(self.file).name}:{self.line} in {self.function}"


@dataclass(frozen=True, kw_only=True)
class Hang:
    """A collective that timed out because some ranks never reached it.

    Attributes:
        missing: the ranks that never reached it (their ledger is behind), lowest first.
        waiting: the ranks that entered it, by rank: their ledger entry.
        last: the missing ranks' last entered collective, by rank.
        stacks: the missing ranks' main-thread stacks (innermost last), by rank; absent: none written.
    """

    missing: list[int]
    waiting: dict[int, Entry]
    last: dict[int, Entry]
    stacks: dict[int, list[Frame]] = field(default_factory=dict)
    timed_out: list[int] = field(default_factory=list)

    def lead(self, script: str, timed_out_at_ns: int) -> str:
        """The summary's first line: who never arrived, what the others waited in, since when, for how long."""
        first = self.waiting[min(self.waiting)]
        names = ", ".join(str(r) for r in self.missing)
        waited = ", ".join(str(r) for r in sorted(self.waiting))
        since = time.strftime("%H:%M:%S", time.localtime(first.since))
        for_s = f" for {max(0.0, timed_out_at_ns / 1e9 - first.since):.1f} s" if timed_out_at_ns else ""
        where = f" at {first.site}" if first.site else ""
        text = (
            f"multigpu launch: {script} hung: rank{'s' if len(self.missing) > 1 else ''} {names} never reached "
            f"collective #{first.seq}, {first.operation}{where}, which rank{'s' if len(self.waiting) > 1 else ''} "
            f"{waited} waited in from {since}{for_s} until the collective timeout"
        )
        for rank in self.missing:
            user = [f for f in self.stacks.get(rank, []) if f.is_user]
            if user:
                text += f"; rank {rank} was at {user[-1]}"
        return text

    def details(self) -> list[str]:
        """Per missing rank: its last collective and its stack (most recent call last)."""
        lines: list[str] = []
        for rank in self.missing:
            last = self.last.get(rank)
            before = (
                f"its last collective was #{last.seq}, {last.operation}" + (f" at {last.site}" if last.site else "")
                if last is not None and last.seq
                else "it had entered no collective yet"
            )
            lines += ["", f"Rank {rank} never arrived ({before}). Its stack when the launcher stopped it:"]
            if last is not None and rank in self.timed_out:
                lines[-1] = (
                    f"Rank {rank} never arrived: it waited in collective #{last.seq}, {last.operation}"
                    + (f" at {last.site}" if last.site else "")
                    + ", instead (the ranks issue collectives in a different order; --debug names each call)."
                )
            stack = self.stacks.get(rank)
            if not stack:
                lines.append("  (none written: it ran on another node, or could not take the signal)")
                continue
            innermost = next((f for f in reversed(stack) if f.is_user), None)
            first = next((i for i, f in enumerate(stack) if f.is_user), 0)  # from the script down, not the runner
            for frame in stack[first:]:
                marker = "  <- here" if frame is innermost else ""
                lines.append(f'  File "{frame.file}", line {frame.line}, in {frame.function}{marker}')
        return lines


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """Everything this node's workers left for the launcher (see the module docstring)."""

    ledgers: dict[int, Entry] = field(default_factory=dict)
    stack_text: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)  # by global rank: the end of its stderr (worker's copy)
    stderr_local: dict[int, str] = field(default_factory=dict)  # by local rank: from torchrun's log files
    unreadable: list[str] = field(default_factory=list)  # "path: why" of each file left out as garbage

    def hang(self, timed_out: list[int]) -> Hang | None:
        """The hang that ``timed_out`` (ranks whose collective timed out) waited on, if the ledgers show one."""
        waiting = {r: self.ledgers[r] for r in timed_out if r in self.ledgers}
        if not waiting:
            return None
        top = max(e.seq for e in waiting.values())
        missing = sorted(r for r, e in self.ledgers.items() if e.seq < top)
        if not missing:
            return None
        return Hang(
            missing=missing,
            waiting={r: e for r, e in waiting.items() if e.seq == top},
            last={r: self.ledgers[r] for r in missing},
            stacks={r: s for r in missing if (s := main_thread_stack(self.stack_text.get(r, ""), self.ledgers[r]))},
            timed_out=[r for r in missing if r in timed_out],
        )

    def diverged(self, timed_out: list[int]) -> dict[int, Entry] | None:
        """The ranks at the collective number ``timed_out`` waited in, if they issued different operations there.

        Without ``--debug`` a collective issued in a different order on different ranks (a reduce on rank 0
        where rank 1 calls a barrier) leaves both waiting; their ledgers name both calls. Only one of them
        need have timed out: the first to time out exits, and the launcher stops the others (or they lose
        their peer) before their own timeout fires, but their ledgers still show where they waited.
        """
        waited = [self.ledgers[r] for r in timed_out if r in self.ledgers]
        if not waited:
            return None
        seq = max(e.seq for e in waited)
        entries = {r: e for r, e in sorted(self.ledgers.items()) if e.seq == seq}
        return entries if len({e.operation for e in entries.values()}) > 1 else None

    def abort_text(self, rank: int, local_rank: int) -> list[str]:
        """What a rank printed about its abort (gloo's or NCCL's words, the failing line), else []."""
        text = self.stderr.get(rank) or self.stderr_local.get(local_rank, "")
        said = [line.strip() for line in text.splitlines() if _is_abort(line)]
        said = [line for line in dict.fromkeys(said) if not line.startswith("Fatal Python error")]
        frames = [f for f in _frames_after(text, "Fatal Python error") if f.is_user]
        if frames:
            said.append(f"Python was at {frames[0]}")
        return said[:4]


def read(folder: str | Path, *, attempt: int, log_dir: str | Path | None, skipped: Sequence[str] = ()) -> Evidence:
    """What the workers of ``attempt`` left in the failure ``folder`` and in torchrun's ``log_dir``.

    Every file is read bounded and only if it is a regular file (:mod:`multigpu.core.run_files`): one that
    is garbage is left out and named in :attr:`Evidence.unreadable`, after ``skipped`` (the failure
    records' own, :func:`multigpu.runtime.failure_records.read`).
    """
    unreadable = list(skipped)
    # the ledgers as the first rank that timed out saw them, else as the workers left them
    ledgers = read_snapshot(folder, attempt=attempt, skipped=unreadable) or read_ledgers(
        folder, attempt=attempt, skipped=unreadable
    )
    stacks = {
        rank: text for rank in ledgers if (text := read_stack(folder, attempt=attempt, rank=rank, skipped=unreadable))
    }
    copies = {rank: _tail(stderr_copy_path(folder, attempt=attempt, rank=rank), unreadable) for rank in ledgers}
    return Evidence(
        ledgers=ledgers,
        stack_text=stacks,
        stderr={rank: text for rank, text in copies.items() if text},
        stderr_local=_stderr_tails(log_dir, attempt, unreadable),
        unreadable=unreadable,
    )


def _is_abort(line: str) -> bool:
    """Whether ``line`` is the backend's word on an abort (ProcessGroupWrapper's "mismatch ... detected" too).

    The ProcessGroup case is two substring searches, not a pattern with two open-ended parts: such a
    pattern takes cubic time on a long line of repeats, and any worker can print one.
    """
    if _ABORT.search(line):
        return True
    lower = line.lower()
    at = lower.find("processgroup")
    return at >= 0 and ("mismatch" in lower[at + 12 :] or "detected" in lower[at + 12 :])


def main_thread_stack(text: str, entry: Entry) -> list[Frame]:
    """The main thread's frames in faulthandler's ``text`` (its last dump), innermost last."""
    wanted = f"0x{entry.main_thread:016x}"
    blocks: dict[str, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in text.splitlines():
        header = _THREAD.match(line)
        if header:
            current = blocks[header.group(1)] = []  # a later dump of the same thread replaces the earlier
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            current.append(Frame(file=frame["file"], line=int(frame["line"]), function=frame["func"].strip()))
    return list(reversed(blocks.get(wanted, [])))


def _frames_after(text: str, marker: str) -> list[Frame]:
    """The crashing thread's frames (innermost first) of the faulthandler dump that follows ``marker``.

    faulthandler lists every thread, the newest first, and marks the one that crashed ``Current thread``.
    A crash on a thread Python does not know (gloo's, NCCL's) has no such mark: then the first thread
    that was in the user's code (the witness thread of :mod:`multigpu.launcher.signal_witness` is newer
    than the main thread, so it comes first), else the first thread.
    """
    at = text.rfind(marker)
    if at < 0:
        return []
    blocks: list[tuple[bool, list[Frame]]] = []
    for line in text[at:].splitlines()[1:]:
        if _THREAD.match(line):
            blocks.append((line.startswith("Current thread"), []))
            continue
        found = _FRAME.match(line)
        if found and blocks:
            blocks[-1][1].append(Frame(file=found["file"], line=int(found["line"]), function=found["func"].strip()))
    for wanted in (lambda current, frames: current, lambda current, frames: any(f.is_user for f in frames)):
        for current, frames in blocks:
            if wanted(current, frames):
                return frames
    return blocks[0][1] if blocks else []


def _stderr_tails(log_dir: str | Path | None, attempt: int, unreadable: list[str]) -> dict[int, str]:
    """The end of each local rank's stderr in torchrun's newest run folder under ``log_dir``."""
    if log_dir is None:
        return {}
    runs = sorted(entries(log_dir, f"*/attempt_{attempt}"), key=modified_ns)
    if not runs:
        return {}
    return {
        int(p.parent.name): _tail(p, unreadable)
        for p in entries(runs[-1], "*/stderr.log")
        if p.parent.name.isascii() and p.parent.name.isdigit()
    }


def _tail(path: Path, unreadable: list[str]) -> str:
    """The end of the text file ``path`` ("" when it is missing; named in ``unreadable`` when it is garbage)."""
    try:
        return read_bytes(path, limit=_KEEP, tail=True).decode(errors="replace")
    except UnreadableFile as exc:
        if os.path.lexists(path):
            unreadable.append(f"{path}: {exc}")
        return ""
