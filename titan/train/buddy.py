"""In-memory snapshots on node-local shared memory, each rank's files also held by a buddy on another node.

Per node, `<snapshot folder>/snap-S/rank-R/` holds the files of step S's snapshot that rank R wrote (its model and
optimizer shards; rank 0 also the shared files and the snapshot's manifest), for the node's own ranks and for the
ranks whose buddy it is. A restart gathers, from the survivors, every rank's files of the newest step some survivor
holds for every rank, and loads them as one checkpoint (docs/fault-tolerance.md)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from titan.checkpoint.checkpointer import Checkpointer
from titan.checkpoint.format import seal, sha256_files

if TYPE_CHECKING:
    from titan.train.elastic import SnapshotInterval

log = logging.getLogger("titan")
SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's per-rank file names
HELD = re.compile(r"^snap-(\d+)$")
INDEX = "snapshot.json"  # in rank 0's files: the snapshot's world and manifest


def buddy_of(rank: int, world: int, local_world: int) -> int | None:
    """The rank that holds a copy of `rank`'s snapshot files: the same local rank on the next node; None on one
    node (no other host to copy to)."""
    return None if local_world >= world else (rank + local_world) % world


def pack(files: dict[str, bytes]) -> torch.Tensor:
    """Files as one byte tensor: an 8-byte header length, a JSON header of names and sizes, then the bytes."""
    header = json.dumps({name: len(data) for name, data in files.items()}).encode()
    blob = len(header).to_bytes(8, "little") + header + b"".join(files.values())
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def unpack(tensor: torch.Tensor) -> dict[str, bytes]:
    blob = tensor.numpy().tobytes()
    start = 8 + int.from_bytes(blob[:8], "little")
    files = {}
    for name, size in json.loads(blob[8:start]).items():
        files[name], start = blob[start : start + size], start + size
    return files


def exchange(files: dict[str, bytes], to: int, source: int, group) -> dict[str, bytes]:
    """Send `files` to rank `to` and receive rank `source`'s, over the (gloo) group: sizes first, then bytes."""
    out, size, theirs = pack(files), torch.tensor([0]), torch.tensor([0])
    size[0] = out.numel()
    for work in (dist.isend(size, to, group=group), dist.irecv(theirs, source, group=group)):
        work.wait()
    received = torch.empty(int(theirs), dtype=torch.uint8)
    for work in (dist.isend(out, to, group=group), dist.irecv(received, source, group=group)):
        work.wait()
    return unpack(received)


class BuddySnapshots(Checkpointer):
    """The snapshot checkpointer for node-local folders: DCP writes each rank's shards on its own host; sealing
    keeps them per rank, with a copy on the buddy's host, instead of one folder on a shared file system."""

    def __init__(self, *args, local_rank: int, local_world: int, interval: SnapshotInterval, **kwargs):
        super().__init__(*args, **kwargs)
        self.interval = interval  # when to snapshot (fault.snapshot_interval)
        self.leader = local_rank == 0  # tidies this host's folder
        self.buddy = buddy_of(self.rank, self.world, local_world)
        self.source = None if self.buddy is None else (self.rank - local_world) % self.world
        if self.buddy is None and self.rank == 0 and self.world > 1:
            log.info("snapshots: all ranks on one node, no buddy copies (a lost node loses its snapshots)")

    def due(self, step: int, final: bool = False) -> bool:
        return self.interval.due(step)

    def _seal(self, tmp: Path, final: Path, proven: bool) -> None:
        mine = sorted(p.name for p in tmp.iterdir() if p.is_file() and self._wrote(p.name))
        hashes = sha256_files(tmp, mine)
        if self.control_group is not None:
            shares: list = [None] * self.world
            dist.all_gather_object(shares, hashes, group=self.control_group)
            hashes = {name: entry for share in shares for name, entry in share.items()}
        files = {name: (tmp / name).read_bytes() for name in mine}
        if self.rank == 0:
            files[INDEX] = json.dumps({"world": self.world, "files": hashes}).encode()
        held = {self.rank: files}
        if self.buddy is not None:
            held[self.source] = exchange(files, self.buddy, self.source, self.control_group)
        step = final.name.removeprefix("step-")
        for rank, rank_files in held.items():
            _write(self.folder / f"snap-{step}" / f"rank-{rank}", rank_files)
        self._barrier()  # every rank has read its files from tmp and written its held ones
        if self.leader:
            shutil.rmtree(tmp, ignore_errors=True)
            for older in self.folder.iterdir():
                if HELD.match(older.name) and older.name != f"snap-{step}":
                    shutil.rmtree(older, ignore_errors=True)

    def _wrote(self, name: str) -> bool:
        """Whether this rank wrote the file `name` of a snapshot: its own shards; rank 0 also every other file."""
        shard = SHARD.match(name)
        return int(shard.group(1)) == self.rank if shard else self.rank == 0

    def gather(self, after: int) -> Path | None:
        """The newest snapshot newer than step `after` whose every rank's files some rank holds, assembled from
        them into a folder of this rank's, sealed as a checkpoint (its caller deletes it once loaded); None if
        there is none."""
        found = _held(self.folder, after)
        everyone = [found]
        if self.control_group is not None:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, found, group=self.control_group)
        holders: dict[int, dict[int, int]] = {}  # step -> {its rank: the lowest rank that holds its files}
        worlds: dict[int, int] = {}
        for holder, steps in reversed(list(enumerate(everyone))):
            for step, (ranks, world) in steps.items():
                holders.setdefault(step, {}).update(dict.fromkeys(ranks, holder))
                worlds[step] = world or worlds.get(step, 0)
        whole = [s for s in holders if worlds[s] and set(holders[s]) >= set(range(worlds[s]))]
        if not whole:
            return None
        step = max(whole)
        mine = {}
        for rank, holder in holders[step].items():
            if holder == self.rank and rank < worlds[step]:
                mine.update((p.name, p.read_bytes()) for p in (self.folder / f"snap-{step}" / f"rank-{rank}").iterdir())
        files = [mine]
        if self.control_group is not None:
            files = [None] * self.world
            dist.all_gather_object(files, mine, group=self.control_group)
        files = {name: data for share in files for name, data in share.items()}
        index = json.loads(files.pop(INDEX))
        folder = self.folder / f".restore-{step}-rank-{self.rank}"
        _write(folder, files)
        seal(folder, index["files"])
        return folder


def _write(folder: Path, files: dict[str, bytes]) -> None:
    """`files` into `folder`, whole or not at all: written aside, then renamed."""
    aside = folder.with_name(".tmp-" + folder.name)
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    for name, data in files.items():
        (aside / name).write_bytes(data)
    shutil.rmtree(folder, ignore_errors=True)
    aside.rename(folder)


def _held(folder: Path, after: int) -> dict[int, tuple[list[int], int | None]]:
    """step -> (the ranks whose files this host holds, the snapshot's world if rank 0's are among them), for the
    snapshots newer than `after`."""
    found = {}
    for snap in folder.iterdir() if folder.is_dir() else ():
        match = HELD.match(snap.name)
        if not match or int(match.group(1)) <= after:
            continue
        ranks = sorted(int(p.name.removeprefix("rank-")) for p in snap.glob("rank-*"))
        index = snap / "rank-0" / INDEX
        found[int(match.group(1))] = (ranks, json.loads(index.read_text())["world"] if index.is_file() else None)
    return found
