"""Elastic restarts: torchrun's agent (`--nnodes MIN:MAX --max-restarts N`) restarts every worker when one fails,
on the world it then has; titan's workers find they are restarted and continue the run from its newest state,
on a new run plan for that world (the same global batch and data order; docs/fault-tolerance.md)."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan.checkpoint.checkpointer import Checkpointer
from titan.checkpoint.resume import complete_checkpoints
from titan.checkpoint.snapshots.buddy import BuddyStorage
from titan.checkpoint.snapshots.folder import (
    SNAPSHOT_DIR,
    check,
    claim,
    release,
    remove_abandoned,
    run_identity,
    shared_memory,
    snapshot_folder,
    snapshots_usable,
)
from titan.checkpoint.snapshots.store import Snapshots
from titan.config import Config
from titan.errors import ConfigError
from titan.launcher import Launch

log = logging.getLogger("titan")


def peak_bytes(checkpointer: Checkpointer, local_world: int, keep: int) -> int:
    """A node's shared memory at a snapshot's peak, from this rank's state (its parameter shards and AdamW's two
    moments of each): the `keep` snapshots held stay until the next is whole beside them (its own files are DCP's,
    linked), each with the buddy copies: 4 times each rank's state for one kept (2 times on one node, without
    buddy copies)."""
    with torch.no_grad():
        params = [p.to_local() if isinstance(p, DTensor) else p for p in checkpointer.states["model"].parameters()]
    state = 3 * sum(p.numel() * p.element_size() for p in params)
    copies = (keep + 1) * (2 if local_world < checkpointer.world else 1)
    return copies * state * local_world


def build_snapshots(config: Config, checkpointer: Checkpointer, launch: Launch, restarted: bool) -> Snapshots | None:
    """The state `checkpointer` saves, snapshotted into this agent's folder on every node (fault.snapshot_interval;
    None when off): the checkpoint's own files and code, in memory, without async saves, keeping the newest, each
    rank's files also on its buddy's node. Each node's first worker removes the folders that agents no longer
    running left on its host, and on a first start what an earlier life of this agent's folder held."""
    every, memory = config.fault.snapshot_interval, shared_memory()
    if not every:
        return None
    if every != "auto" and not memory.is_dir():
        raise ConfigError(
            f"fault.snapshot_interval needs host shared memory ({memory}); set ${SNAPSHOT_DIR} to a folder in it, "
            "or fault.snapshot_interval to 0"
        )
    c, local_world = checkpointer, launch.local_world
    folder = snapshot_folder(config.run_dir)
    if launch.local_rank == 0 and memory.is_dir():
        remove_abandoned(memory)
        if not restarted:
            release(folder)
    keep = 2 if config.replay.on_spike else 1  # a spiked step is replayed from the snapshot before it
    if not _fits(every, c, launch, keep, first_start=not restarted):
        return None
    if launch.local_rank == 0:
        claim(folder, config.run_dir)
    if c.control_group is not None:
        dist.barrier(group=c.control_group)
    check(folder)  # every rank, before it reads or writes any of it
    cfg = dataclasses.replace(config.checkpoint, enable=True, async_save=False, keep_latest_k=keep)
    run = run_identity(config.run_dir)
    storage = BuddyStorage(folder, run, launch, keep=keep, verify=cfg.verify, control_group=c.control_group)
    return Snapshots(c.beside(cfg, folder, storage), storage, peak=peak_bytes(c, local_world, keep))


def _fits(every: int | str, checkpointer: Checkpointer, launch: Launch, keep: int, first_start: bool) -> bool:
    """Whether to snapshot, as every rank agrees: under "auto" only where every rank's snapshots can serve
    (snapshots_usable, or a spike's replay: keep 2); and on a first start only where every node's shared memory
    has room for their peak (peak_bytes): short of it, fault.snapshot_interval = N or replay.on_spike is refused in
    one line, "auto" alone is off with a warning."""
    memory = shared_memory()
    needed = every != "auto" or keep > 1
    usable = needed or snapshots_usable(launch.max_restarts)
    if checkpointer.control_group is not None:  # each node's free space measured once its leader cleared it
        dist.barrier(group=checkpointer.control_group)
    mine = (usable, peak_bytes(checkpointer, launch.local_world, keep), shutil.disk_usage(memory).free if usable else 0)
    everyone = [mine]
    if checkpointer.control_group is not None:
        everyone = [None] * checkpointer.world
        dist.all_gather_object(everyone, mine, group=checkpointer.control_group)
    if not all(usable for usable, _, _ in everyone):
        return False
    need, free = max(need for _, need, _ in everyone), min(free for _, _, free in everyone)
    if not first_start or need <= free:
        return True
    short = f"need {_size(need)} of host shared memory per node at their peak, and {memory} has {_size(free)} free"
    more, elsewhere = (
        "give it more (e.g. docker run --shm-size)",
        f"set ${SNAPSHOT_DIR} to a larger folder in host memory",
    )
    if needed:
        why = f"fault.snapshot_interval {every}" + (" with replay.on_spike" if keep > 1 else "")
        raise ConfigError(f"{why}: the snapshots {short}: {more}, {elsewhere}, or set it to 0")
    if checkpointer.rank == 0:
        log.warning("fault.snapshot_interval auto: no snapshots, they %s: %s or %s", short, more, elsewhere)
    return False


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3g} MiB"


def resume(checkpointer: Checkpointer, snapshots: Snapshots | None, restarted: bool) -> int:
    """Load the state to continue from; returns its step. An elastic restart restores the newest snapshot that
    the survivors hold whole (each rank's files, or its buddy's copy) when it is newer than the disk's newest
    checkpoint; one whose newer snapshots were lost says so in one line and resumes from the disk (as does, quietly,
    one whose disk checkpoint is the newest state: a preemption's save)."""
    if restarted and snapshots is not None:
        disk = max(complete_checkpoints(checkpointer.folder), default=0)
        snapshot, missing = snapshots.gather(checkpointer, after=disk)
        if snapshot is not None:
            log.info("elastic restart: restoring the in-memory snapshot %s (the disk's newest: step %d)", snapshot,
                     disk)  # fmt: skip
            return snapshots.load(checkpointer, snapshot)
        if missing:
            log.warning(
                "elastic restart: no in-memory snapshot newer than the disk's step %d held whole by the survivors "
                "(%s): resuming from the disk checkpoint",
                disk, missing,
            )  # fmt: skip
    return checkpointer.resume(restarted)
