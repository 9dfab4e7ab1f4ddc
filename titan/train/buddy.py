"""In-memory snapshots on node-local shared memory, each rank's files also held by a buddy on another node.

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

from titan.checkpoint.checkpointer import Checkpointer, SaveError
from titan.checkpoint.format import seal, sha256_files
from titan.checkpoint.format.storage import CheckpointReader
from titan.train.recovery.interval import SnapshotInterval
from titan.train.recovery.snapshot_folder import release

log = logging.getLogger("titan")
SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's per-rank file names
HELD = re.compile(r"^snap-(\d+)$")
INDEX = "snapshot.json"  # in rank 0's files: the snapshot's world and manifest


def buddy_of(rank: int, world: int, local_world: int) -> int | None:
    """The rank that holds a copy of `rank`'s snapshot files: the same local rank on the next node; None on one
    node (no other host to copy to)."""
    return None if local_world >= world else (rank + local_world) % world


CHUNK = 64 << 20  # bytes in flight per direction when a rank's files go to its buddy


def exchange(folder: Path, names: list[str], to: int, source: int, into: Path, group, chunk: int = CHUNK) -> None:
    """Send the files `names` of `folder` to rank `to` and write rank `source`'s into `into`, over the (gloo)
    group, `chunk` bytes at a time each way: a rank's state never sits whole in memory (each file is read and
    written in place), however large its share."""
    mine = {name: (folder / name).stat().st_size for name in names}
    theirs = json.loads(_swap(json.dumps(mine).encode(), to, source, group))
    out = [(name, start, min(chunk, size - start)) for name, size in mine.items() for start in range(0, size, chunk)]
    incoming = [(n, start, min(chunk, size - start)) for n, size in theirs.items() for start in range(0, size, chunk)]
    files = {name: os.open(into / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for name in theirs}
    try:
        for i in range(max(len(out), len(incoming))):
            works, received = [], None
            if i < len(out):
                name, start, length = out[i]
                with open(folder / name, "rb") as f:
                    sent = as_tensor(os.pread(f.fileno(), length, start))  # alive until the send is done
                works.append(dist.isend(sent, to, group=group))
            if i < len(incoming):
                received = torch.empty(incoming[i][2], dtype=torch.uint8)
                works.append(dist.irecv(received, source, group=group))
            for work in works:
                work.wait()
            if received is not None:
                os.pwrite(files[incoming[i][0]], received.numpy().tobytes(), incoming[i][1])
    finally:
        for fd in files.values():
            os.close(fd)


def _swap(data: bytes, to: int, source: int, group) -> bytes:
    """Send `data` to rank `to` and return rank `source`'s: the size first, then the bytes."""
    size, theirs = torch.tensor([len(data)]), torch.tensor([0])
    for work in (dist.isend(size, to, group=group), dist.irecv(theirs, source, group=group)):
        work.wait()
    received = torch.empty(int(theirs), dtype=torch.uint8)
    for work in (dist.isend(as_tensor(data), to, group=group), dist.irecv(received, source, group=group)):
        work.wait()
    return received.numpy().tobytes()


class BuddySnapshots(Checkpointer):
    """The snapshot checkpointer for node-local folders: DCP writes each rank's shards on its own host; sealing
    keeps them per rank, with a copy on the buddy's host, instead of one folder on a shared file system."""

    def __init__(self, *args, local_rank: int, local_world: int, interval: SnapshotInterval, run: str, peak: int,
                 **kwargs):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.interval = interval  # when to snapshot (fault.snapshot_interval)
        self.run = run  # the run identity each snapshot's index carries: a restart restores only its own run's
        self.peak = peak  # a node's shared memory at a snapshot's peak (elastic.peak_bytes)
        self.off = False  # set once a snapshot could not be written: training goes on without them
        self.leader = local_rank == 0  # tidies this agent's folder
        self.local_world = local_world
        self.buddy = buddy_of(self.rank, self.world, local_world)
        self.source = None if self.buddy is None else (self.rank - local_world) % self.world
        if self.buddy is None and self.rank == 0 and self.world > 1:
            log.info("snapshots: all ranks on one node, no buddy copies (a lost node loses its snapshots)")

    def due(self, step: int, final: bool = False) -> bool:
        return not self.off and self.interval.due(step)

    def take(self, step: int, tokens_seen: int, loss: float) -> float | None:
        """Snapshot the state at `step`; returns the seconds training was blocked, or None where none was taken:
        one that does not fit or cannot be written turns snapshots off (they only save steps)."""
        if not self.room(step):
            return None
        try:
            blocked = self.save(step, tokens_seen, loss, wait=True)["checkpoint_blocked_s"]
        except SaveError as e:
            self.drop(step, f"its snapshot could not be written ({e.reason})")
            return None
        self.interval.taken(step, blocked)
        return blocked

    def room(self, step: int) -> bool:
        """Whether every node's shared memory has room for one more snapshot beside those it holds (what the
        peak adds to them); short of it on any node, snapshots are off from now on, with one line: they are an
        optimisation, and a full shared memory must not end the run."""
        held = sum(f.stat().st_size for f in self.folder.rglob("*") if f.is_file()) if self.folder.is_dir() else 0
        free = shutil.disk_usage(self.folder).free
        short = torch.tensor([max(0, self.peak - held - free)], dtype=torch.float64)
        if self.control_group is not None:
            dist.all_reduce(short, op=dist.ReduceOp.MAX, group=self.control_group)
        if short.item() > 0:
            self.drop(step, f"a snapshot needs {short.item() / 2**20:.3g} MiB more than is free")
        return not self.off

    def drop(self, step: int, why: str) -> None:
        """Turn snapshots off for the rest of this run (those held stay, for a restart; a half-written one goes),
        with one line."""
        self.off = True
        if self.leader:
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

    def release(self) -> None:
        """Give the agent's shared memory back (its first worker does): the run has ended."""
        if self.leader:
            release(self.folder)

    def _seal(self, tmp: Path, final: Path, proven: bool) -> None:
        mine = sorted(p.name for p in tmp.iterdir() if p.is_file() and self._wrote(p.name))
        hashes = sha256_files(tmp, mine)
        shares = self.everyone(hashes)
        if self.rank == 0:
            files = {name: entry for share in shares for name, entry in share.items()}
            index = {"world": self.world, "run": self.run, "files": files}
            (tmp / INDEX).write_text(json.dumps(index))
            mine.append(INDEX)
        snap = self.folder / f"snap-{final.name.removeprefix('step-')}"
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
            # This one and the newest before it up to keep_latest_k (2 when replay.on_spike replays from the one
            # before); none newer, which an earlier life of the run left.
            held = sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := HELD.match(p.name)))
            step = int(final.name.removeprefix("step-"))
            kept = [s for s in held if s <= step][-self.cfg.keep_latest_k :]
            for other in set(held) - set(kept):
                shutil.rmtree(self.folder / f"snap-{other}", ignore_errors=True)

    def _wrote(self, name: str) -> bool:
        """Whether this rank wrote the file `name` of a snapshot: its own shards; rank 0 also every other file."""
        shard = SHARD.match(name)
        return int(shard.group(1)) == self.rank if shard else self.rank == 0

    def everyone(self, mine):
        """Every rank's `mine` (picklable), by rank."""
        if self.control_group is None:
            return [mine]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.control_group)
        return everyone

    def gather(self, after: int, before: int | None = None) -> tuple[Path | None, str]:
        """The newest snapshot newer than step `after` (and older than `before`, if given) whose every rank's files
        some rank holds, as a checkpoint folder of this rank's holding the bytes this rank's load reads (its caller
        deletes it once loaded); else None and why: none held whole, or a copy to read from that no longer matches its
        hash (checkpoint.verify); "" when no rank holds anything newer (the disk's checkpoint is the newest state: a
        SIGTERM's save)."""
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
        self._fill(folder, snap, holder_of)
        return folder, ""

    def _check_held(self, snap: Path, holder_of: dict[int, int], files: dict[str, dict]) -> list[str]:
        """What is wrong with the copies this rank serves (the ranks' files it is the lowest holder of) against
        the snapshot's manifest: each is hashed once, by its holder."""
        if not self.cfg.verify:
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

    def _fill(self, folder: Path, snap: Path, holder_of: dict[int, int]) -> None:
        """Put into `folder`'s shards the byte ranges this rank's load will read (DCP's own load plan for this
        rank's state): a link to a shard held on this node, the ranges of the others from their holders (one
        all-to-all), so that no rank receives more than its share of the state."""
        metadata = CheckpointReader(folder).read_metadata()
        planner = DefaultLoadPlanner()
        planner.set_up_planner(self._tensor_state(("model", "optimizer")), metadata, self.rank == 0)
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
        sent = [_ranges(snap, requests[r].get(self.rank, [])) for r in range(self.world)]
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


def _ranges(snap: Path, spans: list[tuple[int, str, int, int]]) -> torch.Tensor:
    """The bytes of `spans` (rank, file, offset, length) of the snapshot's held files, one after another."""
    parts = []
    for rank, name, offset, length in spans:
        with open(snap / f"rank-{rank}" / name, "rb") as f:
            parts.append(os.pread(f.fileno(), length, offset))
    return as_tensor(b"".join(parts))


def as_tensor(data: bytes) -> torch.Tensor:
    """`data` as a uint8 tensor of its own (torch.frombuffer refuses an empty buffer)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


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
