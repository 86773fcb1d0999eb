"""A Checkpointer's folder on disk: the names in it, and crash-safe writes into it, one writer at a time.

A checkpoint folder is named exactly ``f"step-{step:08d}"`` (ASCII digits, the step at most
:data:`MAX_STEP`) and holds ``state.pt`` beside its storage's files (:mod:`storages` says which
folders are checkpoints). A file or folder appears under its final name complete, or not at all.
Files go through a hidden temporary sibling (``.<name>.tmp-<host>-<pid>-<random>``: nothing that
looks for checkpoints picks it up), flushed and ``fsync``ed, then ``os.replace``d onto the final
name, then the folder is ``fsync``ed. A complete step folder is put in place by
:func:`install_folder`: one ``rename``, or, to replace a step, ``renameat2(RENAME_EXCHANGE)`` where
the file system has it and a hidden *aside* copy of the old folder elsewhere (``.step-N.prev-...``,
which discovery reads as the same step). The folder lock is the kernel's ``flock``, so a SIGKILL never
leaves a folder locked. OS errors become a :class:`~multigpu.errors.CheckpointError` naming the
path and the fix. The whole story, and which test kills which step, is in docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import platform
import re
import shutil
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from multigpu.errors import CheckpointError

STATE_FILE = "state.pt"
MAX_STEP = 2**63 - 1  # int64, what loggers and torch store steps as
MAX_WORLD_SIZE = 1 << 24
FIX = (
    "Resume from another step (Checkpointer.resume(path=...)), or move this folder away so that the "
    "previous step is the latest."
)
PREFIX = "step-"
TEMP_MARKER = ".tmp-"
LOCK_NAME = ".multigpu.lock"
ASIDE_MARKER = ".prev-"
_STEP = re.compile(r"step-([0-9]{8,19})", re.ASCII)
_ASIDE = re.compile(r"\.(step-[0-9]{8,19})\.prev-.+", re.ASCII)

_MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_PERMISSION_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}


def folder_name(step: int) -> str:
    """The folder name of ``step``.

    Example:
        >>> folder_name(42), folder_name(123456789)
        ('step-00000042', 'step-123456789')
    """
    return f"{PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """The step a folder name stands for, or ``None`` if it is not exactly a name we write.

    Example:
        >>> parse_step("step-00000042"), parse_step("step-42"), parse_step("step-99999999999999999999")
        (42, None, None)
    """
    match = _STEP.fullmatch(name)
    step = int(match.group(1)) if match else -1
    return step if 0 <= step <= MAX_STEP and folder_name(step) == name else None


def parse_aside(name: str) -> int | None:
    """The step of an aside folder name (:func:`aside_name`), or ``None``."""
    match = _ASIDE.fullmatch(name)
    return parse_step(match.group(1)) if match else None


def regular_files(folder: Path, names: tuple[str, ...]) -> bool:
    try:
        return all(stat.S_ISREG(os.lstat(folder / name).st_mode) for name in names)
    except OSError:
        return False


def files_bytes(folder: Path) -> int:
    """The bytes of the regular files directly in ``folder``."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.is_symlink())


def temporary_name(final: Path) -> Path:
    """A unique hidden sibling of ``final`` that checkpoint discovery ignores (host and pid in its name)."""
    return _sibling(final, TEMP_MARKER)


def aside_name(final: Path) -> Path:
    """A hidden sibling of the step folder ``final`` that holds it while it is being replaced."""
    return _sibling(final, ASIDE_MARKER)


def _sibling(final: Path, marker: str) -> Path:
    # The host and pid tell a later run whose leftover it is (remove_stale_temporaries).
    host = socket.gethostname().replace(".", "_")
    return final.with_name(f".{final.name}{marker}{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is a temporary or discarded entry written by this module."""
    return path.name.startswith(".") and TEMP_MARKER in path.name


def fsync(path: Path) -> None:
    """Make a file's data, or a folder's entries (renames, new files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_file(final: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> Path:
    """Write ``final`` (its folder must exist) through ``write(fileobj)``: it is either the old or the new file.

    Raises:
        CheckpointError: the disk is full, a quota or file-size limit was hit, or the folder is not writable;
            the previous file under ``final`` is unchanged.
    """

    def write_to(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)

    return atomic_write_path(final, write_to)


def atomic_write_path(final: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Like :func:`atomic_write_file` for writers that want a path (``write(temporary_path)``)."""
    final = Path(final)
    if final.name in ("", ".."):  # '.', '/', '..': a folder by name (a ValueError from with_name, or EBUSY)
        raise CheckpointError(
            f"could not write checkpoint {str(final)!r}: it names a folder, not a file. Give the path of a file "
            f"(e.g. {str(final / 'weights.safetensors')!r}). Nothing was changed."
        )
    with explain_os_errors(final):
        remove_stale_temporaries(final.parent, name=final.name)  # left by a killed save of this file
        tmp = temporary_name(final)
        try:
            write(tmp)
            fsync(tmp)
            os.replace(tmp, final)
        except BaseException:
            _remove_quietly(tmp)
            raise
        fsync(final.parent)
    return final


def remove_tree(path: Path) -> None:
    """Delete a folder so that no half-deleted folder ever sits under a name discovery would pick.

    The folder is first renamed to a temporary name (atomic), then deleted.
    """
    if path.is_symlink():
        path.unlink()  # never follow a link out of the folder
        return
    if not path.exists():
        return
    doomed = path if is_temporary(path) else temporary_name(path)
    if doomed != path:
        os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_stale_temporaries(folder: Path, *, name: str | None = None) -> None:
    """Delete the temporaries in ``folder`` (only those of the final ``name`` if given) of this host's dead processes.

    Temporaries of other hosts are left alone: whether their writer still runs is unknown here.
    """
    host = socket.gethostname().replace(".", "_")
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        if not is_temporary(entry) or (name is not None and not entry.name.startswith(f".{name}{TEMP_MARKER}")):
            continue
        # Name: .<final name>.tmp-<host>-<pid>-<random>; the host may itself contain dashes.
        parts = entry.name.split(TEMP_MARKER, 1)[1].rsplit("-", 2)
        if len(parts) != 3 or parts[0] != host or not (parts[1].isdigit() and 0 < int(parts[1]) <= _MAX_PID):
            continue  # not a name this module wrote (os.kill would overflow on a pid of 20 digits)
        if not _pid_alive(int(parts[1])):
            _remove_quietly(entry)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


@contextlib.contextmanager
def explain_os_errors(final: Path) -> Iterator[None]:
    """Turn an OSError (anywhere in the raised error's chain) into a CheckpointError explaining it."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        cause = _os_error_in_chain(exc)
        if cause is None:
            raise
        raise CheckpointError(_explain(cause, final)) from exc


def _os_error_in_chain(exc: BaseException | None) -> OSError | None:
    # Writers wrap the OSError of a failed write: torch.save's zip writer raises a RuntimeError
    # while closing, with the OSError as its context.
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _explain(exc: OSError, final: Path) -> str:
    folder, lost = final.parent, f"could not write checkpoint {str(final)!r}"
    code, kept = f"{exc.strerror} (errno {exc.errno})", "The previous checkpoint is unchanged."
    if exc.errno == errno.EFBIG:
        return (
            f"{lost}: {code}: a file-size limit was hit, not a full disk: {_file_size_limit()}. {kept} Raise the "
            "limit where the run starts (ulimit -f unlimited, or the job scheduler's file-size limit), or save "
            "to a file system that allows larger files."
        )
    if exc.errno == errno.EDQUOT:
        return (
            f"{lost}: {code}: the disk quota of this user on {str(folder)!r} is used up. {kept} Free space "
            "within the quota, lower keep_last, or save to another folder."
        )
    if exc.errno in _SPACE_ERRNOS:
        return (
            f"{lost}: {code}. The disk holding {str(folder)!r} is full. {kept} Free space there, lower "
            "keep_last, or save to another folder."
        )
    if exc.errno in _PERMISSION_ERRNOS:
        return (
            f"{lost}: the folder {str(folder)!r} is not writable ({exc.strerror}). {kept} Fix the folder's "
            "permissions or save to a folder this process may write to."
        )
    if exc.errno == errno.EISDIR and os.fspath(final) in (exc.filename, exc.filename2) and final.is_dir():
        return (
            f"{lost}: it is an existing folder. Give the path of a file (e.g. "
            f"{str(final / 'weights.safetensors')!r}), or move the folder away. Nothing was changed."
        )
    if exc.errno == errno.ENOENT and not folder.exists():
        return (
            f"{lost}: the folder {str(folder)!r} does not exist. Create it first (mkdir -p) or pick an existing folder."
        )
    return f"{lost}: {exc}. {kept}"


def _file_size_limit() -> str:
    # EFBIG: this process's RLIMIT_FSIZE (ulimit -f), or the file system's largest file when there is none.
    try:
        import resource  # POSIX only

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limited = soft != resource.RLIM_INFINITY
    except (ImportError, OSError, ValueError):
        soft, limited = 0, False
    if limited:
        return f"this process may write files of at most {soft} bytes (RLIMIT_FSIZE, ulimit -f)"
    return "this process has no file-size limit (RLIMIT_FSIZE), so the file system's largest file size was reached"


@contextlib.contextmanager
def folder_lock(folder: Path, *, timeout_s: float) -> Iterator[None]:
    """Hold the folder's lock, the kernel's ``flock`` on ``<folder>/.multigpu.lock``, for the block.

    The lock belongs to the open file, so the kernel drops it however its holder exits. The file stays
    (removing it would let a waiter lock a file that is no longer the folder's), and holds the holder's
    host and pid while it is held, for the message of a save that waits too long.
    (Written on ``fcntl`` directly: filelock 3 truncates the file when a waiter opens it, which erased
    the holder's record, and filelock 4 conflicts with trackers such as aim that pin filelock<4.)

    Raises:
        CheckpointError: another process held it for ``timeout_s`` seconds (the message names it), or
            something other than a regular file sits under the lock's name.
    """
    path = folder / LOCK_NAME
    fd = _open_lock_file(path, folder)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # EWOULDBLOCK: another open file holds it
                pass
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"another process is saving into {str(folder)!r} and held its lock for "
                    f"{timeout_s:g} s ({_holder(path)}). Two runs are writing one folder: give each "
                    "run its own folder, or raise Checkpointer(lock_timeout_s=...) if saves are slow."
                )
            time.sleep(0.05)
        _write_holder(fd)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # still held: nobody reads a holder that has gone
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open_lock_file(path: Path, folder: Path) -> int:
    # O_NONBLOCK: a FIFO under the lock's name must not block the open; it is refused just below.
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in _SPACE_ERRNOS | _PERMISSION_ERRNOS | {errno.ENOENT}:
            raise  # the folder's own problem: explain_os_errors says it
        raise CheckpointError(_not_a_lock_file(path, folder, exc.strerror or str(exc))) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(_not_a_lock_file(path, folder, "not a regular file"))
    return fd


def _not_a_lock_file(path: Path, folder: Path, why: str) -> str:
    return (
        f"cannot take the lock {str(path)!r} of {str(folder)!r}: {why}. It must be a "
        "regular file (or absent); remove what sits under that name (no save can hold it: none could open "
        "it), or save into another folder."
    )


def _write_holder(fd: int) -> None:
    holder = f"host={socket.gethostname()} pid={os.getpid()} since={time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)


def _holder(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            text = f.read(200).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"


# --- putting a complete folder in place ---
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_SYSCALL_NUMBERS = {"x86_64": 316, "aarch64": 276}  # renameat2, for a libc without the wrapper
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM}

use_exchange = sys.platform.startswith("linux")  # tests turn it off to exercise the fallback


def install_folder(tmp: Path, final: Path) -> None:
    """Give the complete folder ``tmp`` the name ``final``, replacing a previous ``final`` atomically."""
    try:
        os.rename(tmp, final)  # atomic; fails if final is a non-empty folder
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    else:
        fsync(final.parent)
        return
    if use_exchange and exchange(tmp, final):
        fsync(final.parent)
        remove_tree(tmp)  # now the old step
        return
    aside = aside_name(final)
    os.rename(final, aside)
    fsync(final.parent)  # the aside is durable before the name is reused
    os.rename(tmp, final)
    fsync(final.parent)
    remove_tree(aside)


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; ``False`` where this system cannot.

    Raises:
        OSError: the exchange is supported but failed (e.g. a path vanished).
    """
    call = _renameat2()
    if call is None:
        return False
    result = call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _renameat2():  # type: ignore[no-untyped-def]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    wrapper = getattr(libc, "renameat2", None)
    if wrapper is not None:
        wrapper.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        wrapper.restype = ctypes.c_int
        return wrapper
    number = _SYSCALL_NUMBERS.get(platform.machine())
    if number is None:
        return None
    syscall = libc.syscall
    syscall.restype = ctypes.c_long

    def call(olddir: int, old: bytes, newdir: int, new: bytes, flags: int) -> int:
        return int(syscall(ctypes.c_long(number), olddir, old, newdir, new, ctypes.c_uint(flags)))

    return call
