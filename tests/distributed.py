"""Run a function on N local processes joined by a gloo process group, as torchrun would, and collect
each rank's return value. Workers are forked (about twice as cheap to start as spawned) and use one
thread each, so several ranks share the 2 CI cores fairly."""

from __future__ import annotations

import io
import os
import queue as queue_module
import random
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port for a store or rendezvous to listen on, below the kernel's ephemeral range: a port the kernel
    picks (bind to 0) lies in that range, where any process's next outgoing connection may take it before the store
    listens (EADDRINUSE, which a busy machine with many gloo connections meets)."""
    lowest_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    generator = random.Random()
    while True:
        port = generator.randrange(max(1024, lowest_ephemeral - 12000), lowest_ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def _worker(rank: int, world_size: int, port: int, fn, args, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Bytes, not tensors: torch would share tensor storage through file descriptors that die with the worker.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 300) -> list:
    """fn(*args) on every rank; returns the results ordered by rank, or raises with the first rank's error."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                # A rank that died without reporting (a crash) leaves the others waiting in a collective.
                dead = [
                    f"rank {r} exited with {p.exitcode}" for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                ]
                if dead or time.monotonic() > deadline:
                    errors.append("; ".join(dead) or f"timed out after {timeout:.0f}s")
                continue
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            else:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)  # our own workers' data
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
