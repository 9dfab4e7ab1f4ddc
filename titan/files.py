"""Files and folders that survive crashes and concurrent processes: one writer per folder at a time, every
byte on disk before a folder is renamed into place or marked complete, one run per run folder, and write
errors said in plain words."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import platform
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger("titan")


class LockGone(Exception):
    """The folder holding a lock file went away before the lock was ours: the process that held it finished the
    work and removed its scratch folder (a prepared source's units, once merged)."""


@contextlib.contextmanager
def locked(folder: Path, doing: str):
    """Hold `folder`'s lock file; `doing` says what another holder is doing, for the log while waiting. The
    kernel drops the lock when its holder dies, so a killed holder leaves nothing to clean."""
    lock = FileLock(folder.with_name(folder.name + ".lock"))
    try:
        try:
            lock.acquire(blocking=False)
        except Timeout:
            log.info("waiting for another process %s %s", doing, folder)
            lock.acquire()
    except FileNotFoundError:
        raise LockGone(folder) from None
    try:
        yield
    finally:
        lock.release()


def cache_root() -> Path:
    """Where titan caches what it fetches, prepares and compiles: $TITAN_CACHE, else ~/.cache/titan."""
    return Path(os.environ.get("TITAN_CACHE") or Path.home() / ".cache" / "titan").expanduser()


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
    try:
        return _build_locked(folder, is_complete, build, doing)
    except LockGone:
        if is_complete(folder):
            return folder
        raise


def _build_locked(folder: Path, is_complete: Callable[[Path], bool], build: Callable[[Path], None], doing: str):
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


_HELD: dict[Path, object] = {}  # run folders this process holds, and their open lock files


def hold_run_folder(folder: Path) -> None:
    """Hold `folder`'s run lock for the life of this process: a second run on the folder would delete the first
    one's in-progress checkpoints and interleave its metrics. The kernel drops the lock when its holder dies,
    so a lock left by a killed run is simply taken over. Raises BlockingIOError with the holder's host and PID."""
    folder = folder.resolve()
    if folder in _HELD:  # this process holds it already (e.g. a second trainer on the same run, in tests)
        return
    lock = open(folder / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise BlockingIOError(holder) from None
    lock.truncate(0)
    lock.write(f"host {platform.node()} PID {os.getpid()}\n")
    lock.flush()
    _HELD[folder] = lock


# Errors writing that are the machine's state (a full, read-only or forbidden disk), not a bug: the run stops
# with write_error's one line, which says each cause in these words.
_MACHINE_STATE = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
WRITE_ERRORS = tuple(_MACHINE_STATE)


def write_error(e: OSError) -> str:
    """What went wrong writing a file, for a one-line error: the path and the cause in plain words."""
    cause = {
        **_MACHINE_STATE,
        errno.ENOTDIR: "a file stands where a folder is needed",
        errno.EEXIST: "a file stands where a folder is needed",
    }.get(e.errno, e.strerror or str(e))
    return f"cannot write {e.filename or 'a file'}: {cause}"
