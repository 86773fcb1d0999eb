"""Reading a file another process of the run left: regular files only, bounded, JSON of the writer's shape.

Real hostile files on disk (a FIFO, a link to /dev/zero, a sparse file of gigabytes, garbage bytes, JSON
nested deep or holding 1e999): each ends in :class:`UnreadableFile` naming what it is, in bounded time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from multigpu.core.run_files import UnreadableFile, field, read_bytes, read_json, read_tail, write_replacing

LIMIT = 1 << 16


def hostile(kind: str, path: Path) -> Path:
    """Make ``path`` hostile of ``kind`` (the same kinds every reader of the run's files is tested with)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "huge":
        with open(path, "wb") as file:
            file.truncate(8 << 30)  # sparse: 8 GiB of zeros, no disk
    elif kind == "non-utf8":
        path.write_bytes(b'{"rank": 0, "message": "\xff\xfe\xfa"}')
    elif kind == "deep":
        path.write_text("[" * 20_000 + "]" * 20_000)  # within the size limit, past the parser's depth
    elif kind == "inf":
        path.write_text('{"rank": 1e999, "local_rank": 0, "pid": 1e999, "since": 1e999, "when_ns": 1e999}')
    elif kind == "list":
        path.write_text("[1, 2, 3]")
    elif kind == "folder":
        path.mkdir()
    else:
        raise AssertionError(kind)
    return path


KINDS = ["fifo", "dev-zero", "huge", "non-utf8", "deep", "inf", "list", "folder"]


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()``'s result, failing the test when it takes longer than ``seconds`` (a hang stays in a daemon thread)."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            error.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still reading after {seconds} s (a hang)"
    assert time.monotonic() - started < seconds
    if error:
        raise error[0]
    return result[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_file_is_unreadable_at_once(tmp_path: Path, kind: str) -> None:
    path = hostile(kind, tmp_path / "record.json")
    with pytest.raises(UnreadableFile) as caught:
        within(5, lambda: _shaped(read_json(path, limit=LIMIT)))
    why = str(caught.value)
    expected = {
        "fifo": "named pipe",
        "dev-zero": "character device",
        "huge": "more than the 65536 bytes",
        "non-utf8": "not UTF-8",
        "deep": "not the JSON",
        "inf": "1e999 is not finite",
        "list": "holds a list where its writer writes a mapping",
        "folder": "a folder",
    }[kind]
    assert expected in why, why


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_the_tail_of_a_special_file_is_empty_at_once(tmp_path: Path, kind: str) -> None:
    path = hostile(kind, tmp_path / "rank.stderr")
    assert within(5, lambda: read_tail(path, keep=LIMIT)) == ""


def test_the_tail_of_a_huge_file_is_its_last_bytes(tmp_path: Path) -> None:
    path = hostile("huge", tmp_path / "rank.stderr")
    with open(path, "r+b") as file:
        file.seek(-5, os.SEEK_END)
        file.write(b"end\xff\n")
    tail = within(5, lambda: read_tail(path, keep=16))
    assert len(tail.encode()) <= 16 + 2 and tail.endswith("end\ufffd\n")


def test_a_file_that_grows_past_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.write_bytes(b"x" * (LIMIT + 1))
    with pytest.raises(UnreadableFile, match="more than the 65536 bytes"):
        read_bytes(path, limit=LIMIT)
    assert read_bytes(path, limit=LIMIT, tail=True) == b"x" * LIMIT


@pytest.mark.parametrize(
    ("value", "kind", "why"),
    [
        ({"rank": "0"}, int, "'rank' is a str, not a int"),
        ({"rank": True}, int, "'rank' is a bool, not a int"),
        ({"rank": 2**80}, int, "out of range"),
        ({}, int, "'rank' is missing"),
        ({"rank": None}, int, "'rank' is a NoneType"),
        ({"rank": [0]}, int, "'rank' is a list"),
        ({"rank": {"a": 1}}, str, "'rank' is a dict, not a str"),
    ],
)
def test_a_field_of_another_type_is_refused_by_name(value: Any, kind: type, why: str) -> None:
    with pytest.raises(UnreadableFile, match=why):
        field(value, "rank", kind)


def test_a_record_as_its_writer_writes_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"rank": 3, "since": 1.5, "when": 7}')
    data = read_json(path, limit=LIMIT)
    assert (field(data, "rank", int), field(data, "since", float), field(data, "when", float)) == (3, 1.5, 7.0)
    assert field(data, "signal", str, "") == ""


def _shaped(data: Any) -> int:
    """What a reader of a record does after parsing: take its rank as an int."""
    return int(field(data, "rank", int))


def test_two_threads_replacing_one_file_each_leave_it_whole(tmp_path: Path) -> None:
    # the partial file was named by the process alone: one thread removed the other's, or renamed it half-written
    path, texts, failures = tmp_path / "hparams.json", ["a" * 1_000_000, "b" * 1_000_000], []

    def write(text: str) -> None:
        for _ in range(20):
            try:
                write_replacing(path, text)
                if path.read_text() not in texts:
                    failures.append("torn")
            except OSError as error:
                failures.append(repr(error))

    threads = [threading.Thread(target=write, args=(text,)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and sorted(p.name for p in tmp_path.iterdir()) == ["hparams.json"]
