"""Elastic restarts: torchrun's agent (`--nnodes MIN:MAX --max-restarts N`) restarts every worker when one fails,
on the world it then has; titan's workers find they are restarted and continue the run from its newest state,
on a new run plan for that world (the same global batch and data order; docs/fault-tolerance.md)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from titan.checkpoint.checkpointer import Checkpointer
from titan.checkpoint.resume import PARTS, complete_checkpoints
from titan.config import Config
from titan.errors import ConfigError
from titan.train.buddy import BuddySnapshots

log = logging.getLogger("titan")
SHARED_MEMORY = Path("/dev/shm")
SNAPSHOT_DIR = "TITAN_SNAPSHOT_DIR"  # where this node's host shared memory is (default /dev/shm)


def restart_count(group) -> int:
    """torchrun's count of this job's worker restarts, the highest of any rank's: a node taken in at a restart
    starts counting at 0, and must resume as the others do. 0 outside torchrun and at the first start."""
    mine = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if group is None:
        return mine
    count = torch.tensor([mine])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count)


def shared_memory() -> Path:
    """This node's host shared memory: $TITAN_SNAPSHOT_DIR, else /dev/shm."""
    return Path(os.environ.get(SNAPSHOT_DIR) or SHARED_MEMORY)


def snapshot_folder(run_dir: Path) -> Path:
    """Where a run's in-memory snapshots live: host shared memory, which outlives the workers that an elastic
    restart replaces, named after the run folder."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return shared_memory() / f"titan-snapshots-{key}"


def build_snapshots(config: Config, checkpointer: Checkpointer, restarted: bool) -> BuddySnapshots | None:
    """A checkpointer of the same state into the run's snapshot folder on every node (fault.snapshot_interval;
    None when off): the checkpoint's own files and code, in memory, without async saves, keeping the newest, each
    rank's files also on its buddy's node. A first start clears what an earlier run in the same folder left."""
    if not config.fault.snapshot_interval:
        return None
    memory = shared_memory()
    if not memory.is_dir():
        raise ConfigError(
            f"fault.snapshot_interval needs host shared memory ({memory}); set ${SNAPSHOT_DIR} to a folder in it, "
            "or fault.snapshot_interval to 0"
        )
    folder = snapshot_folder(config.run_dir)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not restarted and local_rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    every = config.fault.snapshot_interval
    keep = 2 if config.replay.on_spike else 1  # a spiked step is replayed from the snapshot before it
    cfg = dataclasses.replace(config.checkpoint, enable=True, interval=every, async_save=False, keep_latest_k=keep)
    c = checkpointer
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    groups = {"save_group": c.save_group, "control_group": c.control_group}
    return BuddySnapshots(cfg, folder, c.states, c.record, rank=c.rank, **groups, local_rank=local_rank,
                          local_world=local_world)  # fmt: skip


def resume(checkpointer: Checkpointer, snapshots: BuddySnapshots | None, restarted: bool) -> int:
    """Load the state to continue from; returns its step. An elastic restart restores the newest snapshot that
    the survivors hold whole (each rank's files, or its buddy's copy) when it is newer than the disk's newest
    checkpoint; one whose newer snapshots were lost says so in one line and resumes from the disk (as does, quietly,
    one whose disk checkpoint is the newest state: a preemption's save)."""
    if restarted and snapshots is not None:
        disk = max(complete_checkpoints(checkpointer.folder), default=0)
        snapshot, missing = snapshots.gather(after=disk)
        if snapshot is not None:
            log.info("elastic restart: restoring the in-memory snapshot %s (the disk's newest: step %d)", snapshot,
                     disk)  # fmt: skip
            step = checkpointer.load(snapshot, PARTS)
            shutil.rmtree(snapshot, ignore_errors=True)
            return step
        if missing:
            log.warning(
                "elastic restart: no in-memory snapshot newer than the disk's step %d held whole by the survivors "
                "(%s): resuming from the disk checkpoint",
                disk, missing,
            )  # fmt: skip
    return checkpointer.resume(restarted)
