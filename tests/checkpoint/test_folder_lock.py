"""The checkpoint folder's lock between processes: the holder named, released by a SIGKILL, the file kept."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from multigpu.checkpoint.atomic import LOCK_NAME, folder_lock
from multigpu.errors import CheckpointError
from tests.launching import start_python

_HOLD = """
import sys, time
from pathlib import Path
from multigpu.checkpoint.atomic import folder_lock
with folder_lock(Path(sys.argv[1]), timeout_s=30):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.multiprocess
def test_a_lock_held_by_another_process_names_it_and_a_sigkill_releases_it(tmp_path: Path) -> None:
    holder = start_python("-c", _HOLD, str(tmp_path))
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # the waiter opens the file the holder wrote its name into: the record survives the open
        with pytest.raises(CheckpointError, match=rf"host={socket.gethostname()} pid={holder.pid} since="):
            with folder_lock(tmp_path, timeout_s=0.3):
                pass
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.communicate(timeout=60)
    with folder_lock(tmp_path, timeout_s=5):  # the kernel dropped the dead holder's lock
        assert f"pid={os.getpid()}" in (tmp_path / LOCK_NAME).read_text()
    assert (tmp_path / LOCK_NAME).is_file() and (tmp_path / LOCK_NAME).read_text() == ""  # kept, holder cleared


def test_a_fifo_under_the_lock_name_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / LOCK_NAME)
    with pytest.raises(CheckpointError, match=r"cannot take the lock .*not a regular file.*remove what sits"):
        with folder_lock(tmp_path, timeout_s=1):
            pass


def test_a_symlink_under_the_lock_name_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep me")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).symlink_to(target)
    with pytest.raises(CheckpointError, match=r"cannot take the lock .*remove what sits under that name"):
        with folder_lock(tmp_path / "run", timeout_s=1):
            pass
    assert target.read_text() == "keep me"
