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

log = logging.getLogger("titan")
SHARED_MEMORY = Path("/dev/shm")


def restart_count(group) -> int:
    """torchrun's count of this job's worker restarts, the highest of any rank's: a node taken in at a restart
    starts counting at 0, and must resume as the others do. 0 outside torchrun and at the first start."""
    mine = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if group is None:
        return mine
    count = torch.tensor([mine])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count)


def snapshot_folder(run_dir: Path) -> Path:
    """Where a run's in-memory snapshots live: host shared memory, which outlives the workers that an elastic
    restart replaces, named after the run folder."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return SHARED_MEMORY / f"titan-snapshots-{key}"


def build_snapshots(config: Config, checkpointer: Checkpointer, restarted: bool) -> Checkpointer | None:
    """A checkpointer of the same state into the run's snapshot folder (fault.snapshot_interval; None when off):
    the checkpoint's own files and code, in memory, without async saves, keeping the newest. A first start clears
    what an earlier run in the same folder left."""
    if not config.fault.snapshot_interval:
        return None
    if not SHARED_MEMORY.is_dir():
        raise ConfigError(f"fault.snapshot_interval needs host shared memory ({SHARED_MEMORY}); set it to 0")
    folder = snapshot_folder(config.run_dir)
    if not restarted and checkpointer.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    every = config.fault.snapshot_interval
    cfg = dataclasses.replace(config.checkpoint, enable=True, interval=every, async_save=False, keep_latest_k=1)
    c = checkpointer
    return Checkpointer(
        cfg, folder, c.states, c.record, rank=c.rank, save_group=c.save_group, control_group=c.control_group
    )


def agreed_snapshot(snapshots: Checkpointer, after: int) -> Path | None:
    """The newest complete snapshot newer than step `after` (the disk checkpoint's) if every rank sees the same one
    (ranks on other hosts see their own shared memory), else None."""
    found = complete_checkpoints(snapshots.folder)
    mine = max((s for s in found if s > after), default=-1)
    if snapshots.control_group is not None:
        steps = torch.tensor([mine, -mine])
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=snapshots.control_group)
        if int(steps[0]) != -int(steps[1]):
            return None
    return found.get(mine)


def resume(checkpointer: Checkpointer, snapshots: Checkpointer | None, restarted: bool) -> int:
    """Load the state to continue from; returns its step. An elastic restart restores the newest snapshot when
    every rank has it and it is newer than the disk's newest checkpoint; a restart without one says so in one
    line and resumes from the disk."""
    if restarted and snapshots is not None:
        disk = max(complete_checkpoints(checkpointer.folder), default=0)
        snapshot = agreed_snapshot(snapshots, after=disk)
        if snapshot is not None:
            log.info("elastic restart: restoring the in-memory snapshot %s (the disk's newest: step %d)", snapshot,
                     disk)  # fmt: skip
            return checkpointer.load(snapshot, PARTS)
        log.warning(
            "elastic restart: no in-memory snapshot newer than the disk's step %d on every rank (lost with its "
            "rank): resuming from the disk checkpoint",
            disk,
        )
    return checkpointer.resume(restarted)
