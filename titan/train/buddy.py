"""In-memory snapshots on node-local shared memory, each rank's files also held by a buddy on another node.

Per node, `<snapshot folder>/snap-S/rank-R/` holds the files of step S's snapshot that rank R wrote (its model and
optimizer shards; rank 0 also the shared files and the snapshot's manifest), for the node's own ranks and for the
ranks whose buddy it is, streamed a chunk at a time. A restart picks the newest step some survivor holds for every
rank; each survivor's load then reads the byte ranges it needs from the copies on its own node (links) and from
other nodes' holders (one all-to-all), so no rank receives more than its load reads (docs/fault-tolerance.md)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from titan.checkpoint.checkpointer import Checkpointer
from titan.checkpoint.format import seal, sha256_files
from titan.checkpoint.format.storage import CheckpointReader

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


def snapshot_every(snapshot_s: float, step_s: float, overhead: float) -> int:
    """The fewest steps between two snapshots for which a snapshot's `snapshot_s` is at most `overhead` of their
    time (`step_s` each): the smallest N >= 1 with snapshot_s / (N x step_s) <= overhead."""
    within = lambda n: snapshot_s / (n * step_s) <= overhead  # noqa: E731
    n = max(1, math.ceil(snapshot_s / (overhead * step_s)))
    while n > 1 and within(n - 1):  # the division above rounds either way: the condition itself decides
        n -= 1
    while not within(n):
        n += 1
    return n


class SnapshotInterval:
    """When to snapshot: every N steps (fault.snapshot_interval = N), or under "auto" from measurements: the
    first two steps, then every N steps for the smallest N whose snapshot costs at most fault.snapshot_overhead
    of their time (snapshot_every), from the medians of the latest snapshots' blocked time and of the time per
    step between two, each measurement the highest of any rank's: every rank picks the same N."""

    LATEST = 5  # measurements in the medians: the first snapshot's one-time costs are outvoted from the third on

    def __init__(self, every: int | str, overhead: float, group):
        self.auto, self.overhead, self.group = every == "auto", overhead, group
        self.steps = 1 if self.auto else every
        self.next = 0  # under auto: the step of the next snapshot
        self.blocked: list[float] = []
        self.step_s: list[float] = []
        self.last: tuple[int, float] | None = None  # the step of the latest snapshot, and when it ended

    def due(self, step: int) -> bool:
        return step >= self.next if self.auto else step % self.steps == 0

    def taken(self, step: int, blocked: float) -> None:
        """Snapshot `step` blocked training `blocked` seconds: under auto, measure, and choose the next step."""
        if not self.auto:
            return
        now = time.perf_counter()
        step_s = (now - blocked - self.last[1]) / (step - self.last[0]) if self.last else 0.0
        figures = torch.tensor([blocked, step_s], dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        self.blocked.append(float(figures[0]))
        self.step_s += [float(figures[1])] if self.last else []
        self.last = (step, time.perf_counter())
        if self.step_s:
            self._choose()
        self.next = step + self.steps

    def _choose(self) -> None:
        """The interval from the medians. Once chosen, N changes only where a snapshot every N steps would cost
        more than the overhead, or where N/2 steps would do: noise at a boundary neither flaps it nor floods the
        log."""
        snapshot_s = statistics.median(self.blocked[-self.LATEST :])
        step_s = statistics.median(self.step_s[-self.LATEST :])
        steps = snapshot_every(snapshot_s, step_s, self.overhead)
        if len(self.step_s) == 1 or steps > self.steps or 2 * steps <= self.steps:
            log.info("fault.snapshot_interval auto: a snapshot every %d step%s (it blocks %.3g s, a step takes "
                     "%.3g s: %.2g%% of their time, fault.snapshot_overhead %g)", steps, "s" * (steps > 1),
                     snapshot_s, step_s, 100 * snapshot_s / (steps * step_s), self.overhead)  # fmt: skip
            self.steps = steps


class BuddySnapshots(Checkpointer):
    """The snapshot checkpointer for node-local folders: DCP writes each rank's shards on its own host; sealing
    keeps them per rank, with a copy on the buddy's host, instead of one folder on a shared file system."""

    def __init__(self, *args, local_rank: int, local_world: int, interval: SnapshotInterval, **kwargs):
        super().__init__(*args, **kwargs)
        self.interval = interval  # when to snapshot (fault.snapshot_interval)
        self.leader = local_rank == 0  # tidies this host's folder
        self.local_world = local_world
        self.buddy = buddy_of(self.rank, self.world, local_world)
        self.source = None if self.buddy is None else (self.rank - local_world) % self.world
        if self.buddy is None and self.rank == 0 and self.world > 1:
            log.info("snapshots: all ranks on one node, no buddy copies (a lost node loses its snapshots)")

    def due(self, step: int, final: bool = False) -> bool:
        return self.interval.due(step)

    def _seal(self, tmp: Path, final: Path, proven: bool) -> None:
        mine = sorted(p.name for p in tmp.iterdir() if p.is_file() and self._wrote(p.name))
        hashes = sha256_files(tmp, mine)
        shares = self.everyone(hashes)
        if self.rank == 0:
            index = {"world": self.world, "files": {name: entry for share in shares for name, entry in share.items()}}
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
        for holder, steps in reversed(list(enumerate(self.everyone(_held(self.folder, after, before))))):
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


def _held(folder: Path, after: int, before: int | None) -> dict[int, tuple[list[int], int | None]]:
    """step -> (the ranks whose files this host holds, the snapshot's world if rank 0's are among them), for the
    snapshots newer than `after` and older than `before` (None: any)."""
    found = {}
    for snap in folder.iterdir() if folder.is_dir() else ():
        match = HELD.match(snap.name)
        if not match or not after < int(match.group(1)) < (before or float("inf")):
            continue
        ranks = sorted(int(p.name.removeprefix("rank-")) for p in snap.glob("rank-*"))
        index = snap / "rank-0" / INDEX
        found[int(match.group(1))] = (ranks, json.loads(index.read_text())["world"] if index.is_file() else None)
    return found
