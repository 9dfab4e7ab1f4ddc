"""Where an agent's in-memory snapshots live: a folder in host shared memory (which outlives the workers that an
elastic restart replaces) that belongs to one user, one run and one torchrun agent.

Shared memory is one world-writable folder per host, shared by every user, every container started with the host's
IPC namespace, and every agent on the host. So a snapshot folder is named after all three (the user's uid; the run
folder with torchrun's run id; the agent: its process in its PID namespace on its host), created 0700 and checked
before any use; an `owner.json` in it says whose it is, so that a later start on the host can remove the folders
of agents that are gone."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from titan.errors import ConfigError
from titan.launcher import Launch

log = logging.getLogger("titan")
SHARED_MEMORY = Path("/dev/shm")
SNAPSHOT_DIR = "TITAN_SNAPSHOT_DIR"  # where this node's host shared memory is (default /dev/shm)
PREFIX = "titan-snapshots-"
OWNER = "owner.json"


def shared_memory() -> Path:
    """This node's host shared memory: $TITAN_SNAPSHOT_DIR, else /dev/shm."""
    return Path(os.environ.get(SNAPSHOT_DIR) or SHARED_MEMORY)


def snapshots_usable(max_restarts: int) -> bool:
    """Whether an in-memory snapshot can serve: torchrun restarts the workers after a failure (`max_restarts`,
    its --max-restarts) and this node has host shared memory."""
    return max_restarts > 0 and shared_memory().is_dir()


def run_identity(run_dir: Path) -> str:
    """The run a snapshot belongs to: its folder and torchrun's run id (--rdzv-id; a new one per --standalone
    launch), the same on every node and across the run's restarts."""
    return f"{Path(run_dir).resolve()}|{Launch.from_env().run_id}"


def _agent() -> dict:
    """The process that starts this worker and restarts it (torchrun's agent, or whatever launched it): the same
    for the worker's restarts, another for every other agent on the host, in this container or another."""
    pid = os.getppid()
    return {"host": socket.gethostname(), "pid_namespace": _pid_namespace(), "pid": pid, "started": _started(pid),
            "boot": _boot_id()}  # fmt: skip


def snapshot_folder(run_dir: Path) -> Path:
    """This agent's snapshot folder for the run, in host shared memory."""
    agent = _agent()
    who = json.dumps([run_identity(run_dir), agent["host"], agent["pid_namespace"], agent["pid"], agent["started"]])
    return shared_memory() / f"{PREFIX}{os.getuid()}-{hashlib.sha256(who.encode()).hexdigest()[:16]}"


def claim(folder: Path, run_dir: Path) -> None:
    """Create `folder` for this agent (0700, whatever the umask) with its owner.json, or check the one there."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        check(folder)
        return
    os.chmod(folder, 0o700)  # the umask may have taken more
    owner = {**_agent(), "uid": os.getuid(), "run": run_identity(run_dir)}
    fd = os.open(folder / OWNER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)


@contextlib.contextmanager
def private_files():
    """Files and folders created meanwhile are this user's alone (0600, 0700), whatever the umask: a snapshot's
    are the model and its optimizer state, in a shared memory every local user can list. (The umask is the
    process's: nothing else writes files while a snapshot is taken or gathered.)"""
    umask = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(umask)


def check(folder: Path) -> None:
    """Refuse, in one line, a snapshot folder that is not this user's alone: a link, not a folder, another owner,
    or access for others. Whoever made it could plant the state a restart resumes from."""
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):o}, open to other users"
    else:
        return
    raise ConfigError(
        f"the snapshot folder {folder} {problem}: titan did not make it, and restores nothing from it; remove it, "
        f"or set ${SNAPSHOT_DIR} to a folder of your own (or fault.snapshot_interval to 0)"
    )


def release(folder: Path) -> None:
    """Give the folder's shared memory back."""
    shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class Held:
    """One of this user's snapshot folders in a shared memory: its owner.json (None where it cannot be read), its
    bytes, the steps it holds, and whether its agent is gone (this boot and PID namespace, no such process)."""

    folder: Path
    owner: dict | None
    size: int
    steps: list[int]
    gone: bool


def held_folders(memory: Path) -> list[Held]:
    """This user's snapshot folders in `memory`."""
    here = {"boot": _boot_id(), "pid_namespace": _pid_namespace()}
    found = []
    for folder in sorted(memory.glob(f"{PREFIX}{os.getuid()}-*")):
        try:
            check(folder)
            owner = json.loads((folder / OWNER).read_text())
            if not (isinstance(owner, dict) and isinstance(owner.get("pid"), int)
                    and all(isinstance(owner.get(k), str) for k in ("host", "run"))):  # fmt: skip
                raise ValueError("not an owner.json of titan's")
            gone = all(owner.get(k) == v for k, v in here.items()) and _started(owner["pid"]) != owner.get("started")
        except (OSError, ValueError, ConfigError):
            owner, gone = None, False  # not ours to judge: being made, or not titan's
        found.append(Held(folder, owner, _size(folder), _steps(folder), gone))
    return found


def _size(folder: Path) -> int:
    """The bytes of the files in `folder`, as far as they stay: a running agent adds and removes its snapshots
    while another agent's start or `titan snapshots ls` reads them."""
    size = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                size += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return size


def _steps(folder: Path) -> list[int]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(int(name[5:]) for name in names if name.startswith("snap-") and name[5:].isdigit())


def remove_abandoned(memory: Path) -> list[Held]:
    """Remove this user's snapshot folders in `memory` whose agent is gone, with one line: shared memory is host
    RAM, and a job that ended any way a worker does not see (kill -9, a crash of the agent) left them. Returns
    them."""
    gone = [held for held in held_folders(memory) if held.gone]
    for held in gone:
        release(held.folder)
    if gone:
        size = sum(held.size for held in gone)
        log.info("snapshots: removed %d folder%s of runs no longer running from %s (%.3g MiB of host memory)",
                 len(gone), "s" * (len(gone) > 1), memory, size / 2**20)  # fmt: skip
    return gone


def _started(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot), or None where none runs: a pid the kernel gave to a
    newer process does not pass for the old one."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
