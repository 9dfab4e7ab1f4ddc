"""This machine's save, restore and restart times for the debug recipe (`titan simulate failures --measure`): a
DCP save and load of the tiny model's weights and AdamW moments, a snapshot of them into shared memory, and
torchrun launching a worker, then restarting it in place after it dies."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

PROBE = "titan.tools.simulate.restart_probe"


@dataclass(frozen=True)
class Measured:
    state_bytes: int
    save_s: float  # DCP save to local disk
    load_s: float  # DCP load from it
    snapshot_s: float  # a copy into shared memory (host memory that outlives the workers)
    relaunch_s: float  # torchrun started to its worker's process group joined
    elastic_restart_s: float  # the worker dead to its replacement's process group joined


def measure(config) -> Measured:
    state_bytes, save_s, load_s, snapshot_s = _checkpoint_times(config)
    relaunch_s, elastic_restart_s = _restart_times()
    return Measured(state_bytes, save_s, load_s, snapshot_s, relaunch_s, elastic_restart_s)


def _checkpoint_times(config) -> tuple[int, float, float, float]:
    """The recipe's model and AdamW state on this CPU: bytes, DCP save, DCP load and shared-memory copy seconds."""
    import torch
    import torch.distributed.checkpoint as dcp

    from titan.optim import build_optimizer, ensure_optimizer_state
    from titan.train.build import build_model

    model = build_model(config, torch.device("cpu"))
    named = list(model.named_parameters())
    optimizer = build_optimizer([model], config.optimizer)
    ensure_optimizer_state(optimizer, [p for _, p in named])
    state = {"model": dict(named), "optimizer": {name: optimizer.state[p] for name, p in named}}
    tensors = list(_leaves(state))
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process, as meant
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=folder, no_dist=True)
        saved = time.perf_counter()
        dcp.load(state, checkpoint_id=folder, no_dist=True)
        loaded = time.perf_counter()
    shared = [torch.empty_like(t).share_memory_() for t in tensors]
    for _ in range(2):  # the first copy maps the pages in; snapshots after it reuse them, as the second does
        copied = time.perf_counter()
        for target, source in zip(shared, tensors):
            target.copy_(source)
        snapshot = time.perf_counter() - copied
    return sum(t.numel() * t.element_size() for t in tensors), saved - start, loaded - saved, snapshot


def _leaves(state: dict):
    for value in state.values():
        yield from _leaves(value) if isinstance(value, dict) else [value]


def _restart_times() -> tuple[float, float]:
    """torchrun with one worker and one restart: the worker joins its process group and dies, its replacement joins
    again. Seconds from torchrun's start to the first join, and from the death to the second join."""
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "probe.jsonl"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                   "--max-restarts", "1", "-m", PROBE, str(log)]  # fmt: skip
        start = time.time()
        subprocess.run(command, check=True, capture_output=True, timeout=300)
        first, second = (json.loads(line) for line in log.read_text().splitlines())
    return first["joined"] - start, second["joined"] - first["died"]
