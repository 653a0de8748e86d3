"""Atomic writes (a temporary file named with the writer's pid, fsynced, renamed) and directory locks, which
the kernel releases when their process dies (even under kill -9); the next holder removes what a killed
writer left."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

TMP_MARK = ".tmp"  # temporary files are `<name>.tmp<pid>` (hidden ones `.<name>.tmp<pid>`)


class LockedError(OSError):
    """Another live process holds the directory's lock."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def shown_path(path: Path | str) -> str:
    """`path` relative to the working directory when it lies inside it (true in another checkout), else as given."""
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


@contextlib.contextmanager
def atomic_file(path: Path, hidden: bool = False) -> Iterator[BinaryIO]:
    """A temporary file, fsynced and renamed to `path` on success, removed on any error: readers never see a part."""
    tmp = path.with_name(f"{'.' if hidden else ''}{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, payload: bytes) -> None:
    with atomic_file(path) as f:
        f.write(payload)


def remove_stale_tmp(directory: Path) -> list[Path]:
    """Remove (and return) the temporary files killed writers left in `directory`; only while holding its lock."""
    removed = [p for p in directory.glob(f"*{TMP_MARK}*") if p.is_file() and p.name.rsplit(TMP_MARK, 1)[1].isdigit()]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


@contextlib.contextmanager
def directory_lock(directory: Path, wait: bool = False, tidy: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on `directory` (its `.lock` file, holding the pid) for the block: at once, else
    `LockedError`, or after a log line and waiting (`wait`). `tidy`: a block that raises leaves no lock file nor
    the (empty) directories this call created, so that a waiter locks afresh."""
    while True:
        path = directory.absolute()
        created = list(itertools.takewhile(lambda p: not p.exists(), (path, *path.parents)))  # deepest first
        directory.mkdir(parents=True, exist_ok=True)
        lock = directory / ".lock"
        try:  # and whether this call made it
            fd, new_lock = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, new_lock = os.open(lock, os.O_RDWR), False
            except FileNotFoundError:  # removed between two calls: look again
                continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                error = LockedError(f"{directory} is in use by another process (pid {holder})")
                if not wait:
                    raise error from None
                log.info("%s; waiting for it to finish", error)
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:  # `lock` is another file, or none, where its holder failed and removed it (tidy) while this one waited
                if not os.path.samestat(os.fstat(fd), os.stat(lock)):
                    continue
            except FileNotFoundError:
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            try:
                yield
            except BaseException:
                if tidy:  # the lock file goes while held (a waiter sees it gone), then the empty directories
                    if new_lock:
                        lock.unlink(missing_ok=True)
                    with contextlib.suppress(OSError):  # not empty: something else is in it now
                        for created_dir in created:
                            created_dir.rmdir()
                raise
            return
        finally:
            os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def waiting_lock(directory: Path, tidy: bool = False) -> Iterator[None]:
    """`directory_lock`, waiting when it is held; then what killed writers left there goes."""
    with directory_lock(directory, wait=True, tidy=tidy):
        for path in remove_stale_tmp(directory):
            log.info("Removed %s, left by a writer that was killed", path)
        yield
