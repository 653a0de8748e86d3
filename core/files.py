"""File helpers shared by data preparation, training, evaluation and the corpora cache.

Writes are atomic (a temporary file beside the target, fsynced, then renamed), temporary names
carry the writer's pid so that two processes never write one file, and a directory lock keeps two
live writers (two runs, two prepares) out of one directory. A lock is released by the kernel when
its process dies, even under kill -9, so it never goes stale; the temporary files a killed writer
left are removed by the next holder of the lock. A writer that fails can have its lock file and the
directories it created removed (`directory_lock(..., tidy=True)`): a waiter then locks afresh.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

TMP_MARK = ".tmp"
"""Temporary files are named `<name>.tmp<pid>` (hidden ones `.<name>.tmp<pid>`)."""


class LockedError(OSError):
    """Another live process holds the directory's lock."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def shown_path(path: Path | str) -> str:
    """`path` relative to the working directory when it lies inside it, else as given: what a record
    (results.json, a report) names, so that it stays true in another checkout."""
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


def tmp_path(path: Path, hidden: bool = False) -> Path:
    """The temporary name this process writes `path` under."""
    return path.with_name(f"{'.' if hidden else ''}{path.name}{TMP_MARK}{os.getpid()}")


@contextlib.contextmanager
def atomic_file(path: Path, hidden: bool = False) -> Iterator[BinaryIO]:
    """Open a temporary file for writing; on success it is fsynced and renamed to `path`, on any
    error (or interruption) it is removed: readers see the old file or the new one, never a part."""
    tmp = tmp_path(path, hidden)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, payload: bytes) -> None:
    """Write `payload` to `path` atomically (see `atomic_file`)."""
    with atomic_file(path) as f:
        f.write(payload)


def remove_stale_tmp(directory: Path) -> list[Path]:
    """Remove the temporary files that killed writers left in `directory`; call it only while holding
    the directory's lock (no live writer can then be using them). Returns what was removed."""
    removed = []
    for path in directory.glob(f"*{TMP_MARK}*"):
        suffix = path.name.rsplit(TMP_MARK, 1)[1]
        if path.is_file() and suffix.isdigit():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def directory_lock(directory: Path, wait: bool = False, tidy: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on `directory` (its `.lock` file) for the duration of the block.

    `wait=False` raises `LockedError` at once when another process holds it; `wait=True` blocks
    until that process finishes (or dies). The `.lock` file holds the holder's pid, for messages.
    `tidy=True`: when the block raises, the lock file and the directories this call created are
    removed again (directories only while empty), so that a failed writer leaves nothing behind.
    """
    while True:
        created = _missing_dirs(directory)
        directory.mkdir(parents=True, exist_ok=True)
        lock = directory / ".lock"
        fd, new_lock = _open_lock(lock)
        if fd is None:  # removed between two calls: look again
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise LockedError(f"{directory} is in use by another process (pid {holder})") from None
            if not _same_file(fd, lock):  # its holder failed and removed it (tidy) while this one waited
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            try:
                yield
            except BaseException:
                if tidy:
                    _tidy(lock if new_lock else None, created)
                raise
            return
        finally:
            os.close(fd)  # closing releases the lock


def _open_lock(lock: Path) -> tuple[int | None, bool]:
    """(descriptor of `lock`, whether this call created it); None when it vanished meanwhile."""
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass
    try:
        return os.open(lock, os.O_RDWR), False
    except FileNotFoundError:
        return None, False


def _missing_dirs(directory: Path) -> list[Path]:
    """`directory` and those of its parents that do not exist yet, deepest first."""
    missing = []
    path = directory.absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` is still the file open as `fd` (not removed, nor replaced by another)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _tidy(lock: Path | None, created: list[Path]) -> None:
    """Remove the lock file (while it is held: a waiter then sees it gone and locks afresh) and the
    directories in `created` (deepest first) that are empty."""
    if lock is not None:
        lock.unlink(missing_ok=True)
    for path in created:
        try:
            path.rmdir()
        except OSError:  # not empty: something else is in it now
            return


@contextlib.contextmanager
def waiting_lock(directory: Path, tidy: bool = False) -> Iterator[None]:
    """`directory_lock`: at once when free, else after one log line saying whose it is and that this process
    waits for it (a prepare or a corpus build of minutes, say); then what killed writers left there goes (a
    SIGTERM skips `atomic_file`'s clean-up: an 88 MB half-built corpus, say)."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(directory_lock(directory, tidy=tidy))
        except LockedError as error:
            log.info("%s; waiting for it to finish", error)
            stack.enter_context(directory_lock(directory, wait=True, tidy=tidy))
        for path in remove_stale_tmp(directory):
            log.info("Removed %s, left by a writer that was killed", path)
        yield
