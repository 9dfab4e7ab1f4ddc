"""Where the Checkpointer's saves land by default: one folder per checkpoint on a file system every rank sees.

A Storage is the last part of a save: the Checkpointer writes a save's files into a temporary folder, and its
storage makes them the checkpoint of that step, whole or not at all, then drops the ones it no longer keeps. This
one renames the folder into place and keeps the newest keep_latest_k and the last good; checkpoint/snapshots/ holds
the in-memory one that keeps each rank's files on its own node.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from titan.checkpoint.format import PROVEN, seal, sha256_files
from titan.checkpoint.resume import complete_checkpoints
from titan.files import fsync, write_synced


class Storage(Protocol):
    kind: str  # what a save is called in the log: "checkpoint", "snapshot"

    def where(self, final: Path) -> Path:
        """Where the save `final` lands, as the log names it."""

    def seal(self, tmp: Path, final: Path, proven: bool) -> None:
        """Make the save written into `tmp` (by every rank, which all call this) the checkpoint `final`; `proven`:
        mark it known good (its next step already ran healthy)."""


class DiskStorage:
    """Checkpoints as folders `<folder>/step-N/` on a file system every rank sees."""

    kind = "checkpoint"

    def __init__(self, folder: Path, keep_latest_k: int, rank: int, world: int, control_group):
        self.folder, self.keep_latest_k = folder, keep_latest_k
        self.rank, self.world, self.control_group = rank, world, control_group

    def where(self, final: Path) -> Path:
        return final

    def seal(self, tmp: Path, final: Path, proven: bool) -> None:
        # Every rank hashes its share of the files (a shared file system, as the rename below needs already).
        names = sorted(p.name for p in tmp.iterdir() if p.is_file())
        mine = sha256_files(tmp, names[self.rank :: self.world])
        if self.control_group is not None:
            shares: list = [None] * self.world
            dist.all_gather_object(shares, mine, group=self.control_group)
            mine = {name: entry for share in shares for name, entry in share.items()}
        if self.rank != 0:
            return
        seal(tmp, mine)
        replaced = final.with_name(".replaced-" + final.name)
        if final.exists():  # a rewound run saving a step again: the old one goes once the new one is in place
            final.rename(replaced)
        tmp.rename(final)  # atomic: the checkpoint appears complete or not at all
        fsync(self.folder)
        shutil.rmtree(replaced, ignore_errors=True)
        if proven:
            prove(final)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest keep_latest_k checkpoints, and always the last good one."""
        if not self.keep_latest_k:
            return
        found = list(complete_checkpoints(self.folder).values())
        keep = {*found[-self.keep_latest_k :], last_good(self.folder)}
        for old in found:
            if old not in keep:
                doomed = old.with_name(".pruned-" + old.name)  # renamed first: never a half-deleted "complete" one
                old.rename(doomed)
                shutil.rmtree(doomed, ignore_errors=True)


def prove(path: Path) -> None:
    """Mark the checkpoint at `path` known good: an empty file outside the manifest, so that created or not, the
    checkpoint stays whole and verifiable."""
    write_synced(path / PROVEN, b"")
    fsync(path)


def last_good(folder: Path) -> Path | None:
    """The newest complete checkpoint in `folder` whose next step ran healthy: resuming from it does not meet the
    same NaN. (The final step's checkpoint, whose next step never ran, is not one until a later run proves it.)"""
    for path in reversed(complete_checkpoints(folder).values()):
        if (path / PROVEN).is_file():
            return path
    return None
