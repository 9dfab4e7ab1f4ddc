"""The bytes of snapshot files between ranks, over a gloo group: a rank's files to its buddy, a chunk at a time each
way, and the byte ranges one rank's load reads from the files another holds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

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


def ranges(snap: Path, spans: list[tuple[int, str, int, int]]) -> torch.Tensor:
    """The bytes of `spans` (rank, file, offset, length) of the snapshot's held files, one after another."""
    parts = []
    for rank, name, offset, length in spans:
        with open(snap / f"rank-{rank}" / name, "rb") as f:
            parts.append(os.pread(f.fileno(), length, offset))
    return as_tensor(b"".join(parts))


def as_tensor(data: bytes) -> torch.Tensor:
    """`data` as a uint8 tensor of its own (torch.frombuffer refuses an empty buffer)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
