"""Cache folders that survive crashes and concurrent processes: one writer per folder at a time, and every
byte on disk before a folder is renamed into place or marked complete."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("titan")


@contextlib.contextmanager
def locked(folder: Path, doing: str):
    """Hold `folder`'s lock file; `doing` says what another holder is doing, for the log while waiting."""
    with open(folder.with_name(folder.name + ".lock"), "a") as lock:  # "a": create it, never truncate
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process %s %s", doing, folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock, as the death of its process does


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync(path: Path) -> None:
    """Flush a file, or a folder's entries (so a rename in it survives a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_once(folder: Path, is_complete: Callable[[Path], bool], build: Callable[[Path], None], doing: str) -> Path:
    """`folder`, built by `build(tmp)` into a temporary folder renamed into place, unless it is complete
    already. Processes that race wait for the one building; a build killed midway leaves only a temporary
    folder, which the next build removes."""
    if is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with locked(folder, doing):
        if is_complete(folder):  # another process built it while this one waited
            return folder
        # Whoever left these held the lock this process holds now: they are gone, interrupted.
        for stale in [*folder.parent.glob(f".{folder.name}.tmp-*"), folder]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
        try:
            tmp.mkdir()
            build(tmp)
            fsync(tmp)
            os.rename(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync(folder.parent)
    return folder
