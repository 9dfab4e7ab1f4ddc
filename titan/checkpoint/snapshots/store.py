"""An agent's in-memory snapshots of the training state: a Checkpointer of the run's own state (its files and code,
without async saves) whose storage keeps them in shared memory with buddy copies (buddy.py), and the rules that
keep them an optimisation: a snapshot that does not fit or cannot be written turns them off, never the run."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from titan.checkpoint.checkpointer import Checkpointer, SaveError
from titan.checkpoint.resume import PARTS
from titan.checkpoint.snapshots.buddy import BuddyStorage
from titan.checkpoint.snapshots.folder import private_files, release

log = logging.getLogger("titan")


class Snapshots:
    """`checkpointer` saves into `storage`'s folder; peak: a node's shared memory at a snapshot's peak."""

    def __init__(self, checkpointer: Checkpointer, storage: BuddyStorage, peak: int):
        self.checkpointer, self.storage, self.peak = checkpointer, storage, peak
        self.folder, self.rank = storage.folder, storage.rank
        self.off = False  # set once a snapshot could not be written: training goes on without them

    def take(self, step: int, tokens_seen: int, loss: float) -> float | None:
        """Snapshot the state at `step`; returns the seconds training was blocked, or None where none was taken:
        one that does not fit or cannot be written turns snapshots off (they only save steps)."""
        if self.off or not self.room(step):
            return None
        try:
            with private_files():
                return self.checkpointer.save(step, tokens_seen, loss, wait=True)["checkpoint_blocked_s"]
        except SaveError as e:
            self.drop(step, f"its snapshot could not be written ({e.reason})")
            return None

    def room(self, step: int) -> bool:
        """Whether every node's shared memory has room for one more snapshot beside those it holds (what the
        peak adds to them); short of it on any node, snapshots are off from now on, with one line: they are an
        optimisation, and a full shared memory must not end the run."""
        held = sum(f.stat().st_size for f in self.folder.rglob("*") if f.is_file()) if self.folder.is_dir() else 0
        free = shutil.disk_usage(self.folder).free
        short = torch.tensor([max(0, self.peak - held - free)], dtype=torch.float64)
        if self.storage.control_group is not None:
            dist.all_reduce(short, op=dist.ReduceOp.MAX, group=self.storage.control_group)
        if short.item() > 0:
            self.drop(step, f"a snapshot needs {short.item() / 2**20:.3g} MiB more than is free")
        return not self.off

    def drop(self, step: int, why: str) -> None:
        """Turn snapshots off for the rest of this run (those held stay, for a restart; a half-written one goes),
        with one line."""
        self.off = True
        if self.storage.leader:
            shutil.rmtree(self.folder / f".tmp-step-{step}", ignore_errors=True)
            for aside in self.folder.glob(f"snap-{step}/.tmp-rank-*"):
                shutil.rmtree(aside, ignore_errors=True)
        if self.rank == 0:
            log.warning(
                "snapshots off from step %d: %s in %s; training goes on without them (free host shared "
                "memory, or set $TITAN_SNAPSHOT_DIR to a larger folder in host memory)",
                step,
                why,
                self.folder,
            )

    def gather(self, into: Checkpointer, after: int, before: int | None = None) -> tuple[Path | None, str]:
        """The newest snapshot between the steps `after` and `before` (None: any newer) that the ranks hold whole,
        as a folder holding what `into`'s load reads (BuddyStorage.gather); else None and why ("" when none newer
        exists)."""
        with private_files():
            return self.storage.gather(into.tensor_state(("model", "optimizer")), after, before)

    @staticmethod
    def load(into: Checkpointer, folder: Path) -> int:
        """Load the gathered `folder` into `into`'s state, then remove it; returns its step."""
        step = into.load(folder, PARTS)
        shutil.rmtree(folder, ignore_errors=True)
        return step

    def everyone(self, mine) -> list:
        """Every rank's `mine` (picklable), by rank."""
        return self.storage.everyone(mine)

    def release(self) -> None:
        """Give the agent's shared memory back (its first worker does): the run has ended."""
        if self.storage.leader:
            release(self.folder)
