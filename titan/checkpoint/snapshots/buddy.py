"""Snapshots on node-local shared memory, each rank's files also held by a buddy on another node: a Storage of
the Checkpointer (checkpoint/disk.py has the protocol).

Per node, `<snapshot folder>/snap-S/rank-R/` holds the files of step S's snapshot that rank R wrote (its model and
optimizer shards; rank 0 also the shared files and the snapshot's manifest), for the node's own ranks and for the
ranks whose buddy it is, streamed a chunk at a time. A restart picks the newest step some survivor holds for every
rank; each survivor's load then reads the byte ranges it needs from the copies on its own node (links) and from
other nodes' holders (one all-to-all), so no rank receives more than its load reads (docs/fault-tolerance.md)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from titan.checkpoint.format import seal, sha256_files
from titan.checkpoint.format.storage import CheckpointReader
from titan.checkpoint.snapshots.exchange import exchange, ranges
from titan.launcher import Launch

log = logging.getLogger("titan")
SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's per-rank file names
HELD = re.compile(r"^snap-(\d+)$")
INDEX = "snapshot.json"  # in rank 0's files: the snapshot's world and manifest


def buddy_of(rank: int, world: int, local_world: int) -> int | None:
    """The rank that holds a copy of `rank`'s snapshot files: the same local rank on the next node; None on one
    node (no other host to copy to)."""
    return None if local_world >= world else (rank + local_world) % world


class BuddyStorage:
    """A snapshot's files kept per rank in this agent's `folder` (node-local), with a copy on the buddy's node,
    instead of one folder on a shared file system. run: the run identity each snapshot's index carries (a restart
    restores only its own run's); launch: this process's rank, world and agent; keep: the snapshots held (2 where a
    spike's replay starts from the older); verify: check a held copy against the snapshot's manifest before
    restoring from it."""

    def __init__(self, folder: Path, run: str, launch: Launch, *, keep: int, verify: bool, control_group):
        self.folder, self.run, self.keep, self.verify = folder, run, keep, verify
        self.rank, self.world, self.local_world = launch.rank, launch.world, launch.local_world
        self.control_group = control_group
        self.leader = launch.local_rank == 0  # the agent's first worker: tidies its folder
        rank, world, local_world = self.rank, self.world, self.local_world
        self.buddy = buddy_of(rank, world, local_world)
        self.source = None if self.buddy is None else (rank - local_world) % world
        if self.buddy is None and rank == 0 and world > 1:
            log.info("snapshots: all ranks on one node, no buddy copies (a lost node loses its snapshots)")

    kind = "snapshot"

    def where(self, final: Path) -> Path:
        return self.folder / f"snap-{final.name.removeprefix('step-')}"

    def seal(self, tmp: Path, final: Path, proven: bool) -> None:
        mine = sorted(p.name for p in tmp.iterdir() if p.is_file() and self._wrote(p.name))
        hashes = sha256_files(tmp, mine)
        shares = self.everyone(hashes)
        if self.rank == 0:
            files = {name: entry for share in shares for name, entry in share.items()}
            index = {"world": self.world, "run": self.run, "files": files}
            (tmp / INDEX).write_text(json.dumps(index))
            mine.append(INDEX)
        snap = self.where(final)
        own = _aside(snap / f"rank-{self.rank}")
        for name in mine:  # the same file system: links, not copies
            _link(tmp / name, own / name)
        held = [own]
        if self.buddy is not None:
            held.append(_aside(snap / f"rank-{self.source}"))
            exchange(tmp, mine, self.buddy, self.source, held[1], self.control_group)
        for aside in held:
            _publish(aside)
        self._barrier()  # every rank has taken its files from tmp and written its held ones
        if self.leader:
            shutil.rmtree(tmp, ignore_errors=True)
            # This one and the newest before it up to keep (2 when replay.on_spike replays from the one
            # before); none newer, which an earlier life of the run left.
            held = sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := HELD.match(p.name)))
            step = int(final.name.removeprefix("step-"))
            kept = [s for s in held if s <= step][-self.keep :]
            for other in set(held) - set(kept):
                shutil.rmtree(self.folder / f"snap-{other}", ignore_errors=True)

    def _wrote(self, name: str) -> bool:
        """Whether this rank wrote the file `name` of a snapshot: its own shards; rank 0 also every other file."""
        shard = SHARD.match(name)
        return int(shard.group(1)) == self.rank if shard else self.rank == 0

    def _barrier(self) -> None:
        if self.control_group is not None:
            dist.barrier(group=self.control_group)

    def everyone(self, mine):
        """Every rank's `mine` (picklable), by rank."""
        if self.control_group is None:
            return [mine]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.control_group)
        return everyone

    def gather(self, state: dict, after: int, before: int | None = None) -> tuple[Path | None, str]:
        """The newest snapshot newer than step `after` (and older than `before`, if given) whose every rank's files
        some rank holds, as a checkpoint folder of this rank's holding the bytes this rank's load reads (its caller
        deletes it once loaded); else None and why: none held whole, or a copy to read from that no longer matches its
        hash (checkpoint.verify); "" when no rank holds anything newer (the disk's checkpoint is the newest state: a
        SIGTERM's save). state: the tensors the load fills (Checkpointer.tensor_state), whose read ranges it fetches."""
        holders: dict[int, dict[int, int]] = {}  # step -> {its rank: the lowest rank that holds its files}
        worlds: dict[int, int] = {}
        for holder, steps in reversed(list(enumerate(self.everyone(_held(self.folder, after, before, self.run))))):
            for step, (ranks, world) in steps.items():
                holders.setdefault(step, {}).update(dict.fromkeys(ranks, holder))
                worlds[step] = world or worlds.get(step, 0)
        whole = [s for s in holders if worlds[s] and set(holders[s]) >= set(range(worlds[s]))]
        if not whole:  # some rank's files of a newer step are on no survivor; or none newer exists (nothing lost)
            return None, "a rank and its buddy copy both lost" if holders else ""
        step = max(whole)
        snap, holder_of = self.folder / f"snap-{step}", holders[step]
        # Rank 0's small files (the index, train state, data position) go to every rank; the shards stay put.
        small = {}
        if holder_of[0] == self.rank:
            small = {p.name: p.read_bytes() for p in (snap / "rank-0").iterdir() if not SHARD.match(p.name)}
        small = {name: data for share in self.everyone(small) for name, data in share.items()}
        files = json.loads(small.pop(INDEX))["files"]
        problems = [p for share in self.everyone(self._check_held(snap, holder_of, files)) for p in share]
        if problems:
            return None, f"step {step}'s {problems[0]}"
        folder = self.folder / f".restore-{step}-rank-{self.rank}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for name, data in small.items():
            (folder / name).write_bytes(data)
        for name, entry in files.items():
            if SHARD.match(name):  # sparse until its read ranges are filled in
                with open(folder / name, "wb") as f:
                    f.truncate(entry["size"])
        seal(folder, files)
        self._fill(folder, snap, holder_of, state)
        return folder, ""

    def _check_held(self, snap: Path, holder_of: dict[int, int], files: dict[str, dict]) -> list[str]:
        """What is wrong with the copies this rank serves (the ranks' files it is the lowest holder of) against
        the snapshot's manifest: each is hashed once, by its holder."""
        if not self.verify:
            return []
        problems = []
        for rank in (r for r, holder in holder_of.items() if holder == self.rank):
            names = [n for n in files if (int(SHARD.match(n).group(1)) if SHARD.match(n) else 0) == rank]
            try:
                held = sha256_files(snap / f"rank-{rank}", names)
            except OSError as e:
                problems.append(f"rank {rank}'s copy on rank {self.rank}'s node is incomplete ({e.strerror})")
                continue
            problems += [
                f"{name}, rank {rank}'s copy on rank {self.rank}'s node, does not match its SHA-256"
                for name in names
                if held[name]["sha256"] != files[name]["sha256"]
            ]
        return problems

    def _fill(self, folder: Path, snap: Path, holder_of: dict[int, int], state: dict) -> None:
        """Put into `folder`'s shards the byte ranges this rank's load will read (DCP's own load plan for this
        rank's state): a link to a shard held on this node, the ranges of the others from their holders (one
        all-to-all), so that no rank receives more than its share of the state."""
        metadata = CheckpointReader(folder).read_metadata()
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state, metadata, self.rank == 0)
        wanted: dict[str, set[tuple[int, int]]] = {}
        for item in planner.create_local_plan().items:
            info = metadata.storage_data[item.storage_index]
            wanted.setdefault(info.relative_path, set()).add((info.offset, info.length))
        asked: dict[int, list[tuple[int, str, int, int]]] = {}  # holder -> [(rank, file, offset, length)]
        for name, spans in sorted(wanted.items()):
            rank = int(SHARD.match(name).group(1))
            if holder_of[rank] // self.local_world == self.rank // self.local_world:  # on this node
                (folder / name).unlink()
                _link(snap / f"rank-{rank}" / name, folder / name)
            else:
                asked.setdefault(holder_of[rank], []).extend((rank, name, *span) for span in sorted(spans))
        if self.control_group is None:
            return
        requests = self.everyone(asked)
        sent = [ranges(snap, requests[r].get(self.rank, [])) for r in range(self.world)]
        sizes = [sum(length for *_, length in asked.get(r, [])) for r in range(self.world)]
        received = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.all_to_all_single(received, torch.cat(sent), sizes, [len(s) for s in sent], group=self.control_group)
        data, start = received.numpy(), 0
        for holder in range(self.world):
            for _rank, name, offset, length in asked.get(holder, []):
                with open(folder / name, "r+b") as f:
                    os.pwrite(f.fileno(), data[start : start + length].tobytes(), offset)
                start += length
        log.info(
            "snapshot restore: rank %d fetched %d of the %d bytes its load reads from other nodes",
            self.rank, sum(sizes), sum(length for spans in wanted.values() for _, length in spans),
        )  # fmt: skip


def _link(source: Path, target: Path) -> None:
    """`target` as a hard link to `source`, or a copy where the file system has none."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _aside(folder: Path) -> Path:
    """An empty folder beside `folder`, to fill and then _publish as it."""
    aside = folder.with_name(".tmp-" + folder.name)
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    return aside


def _publish(aside: Path) -> None:
    """`aside` renamed to the folder it stands for, whole or not at all."""
    folder = aside.with_name(aside.name.removeprefix(".tmp-"))
    shutil.rmtree(folder, ignore_errors=True)
    aside.rename(folder)


def _held(folder: Path, after: int, before: int | None, run: str) -> dict[int, tuple[list[int], int | None]]:
    """step -> (the ranks whose files this agent holds, the snapshot's world if rank 0's are among them), for the
    snapshots newer than `after` and older than `before` (None: any); none of a snapshot whose index names another
    run."""
    found = {}
    for snap in folder.iterdir() if folder.is_dir() else ():
        match = HELD.match(snap.name)
        if not match or not after < int(match.group(1)) < (before or float("inf")):
            continue
        ranks = sorted(int(p.name.removeprefix("rank-")) for p in snap.glob("rank-*"))
        index = json.loads((snap / "rank-0" / INDEX).read_text()) if (snap / "rank-0" / INDEX).is_file() else None
        if index is None or index.get("run") == run:
            found[int(match.group(1))] = (ranks, index["world"] if index else None)
    return found
