"""What the tests of elastic runs share: torchrun agents started as nodes, and the steps their runs logged."""

import json
import os
import subprocess
import time
from pathlib import Path

from conftest import DEBUG_RECIPE, ROOT
from helpers import TINY_MODEL

# torchrun's agent gives each restart a store of its own, where no dead worker's address is left to read.
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RUN = {**TINY_MODEL, "training.seq_len": "32", "optimizer.lr": "3e-3", "training.global_batch_size": "8"}


def logged_steps(metrics: Path) -> list[dict]:
    """metrics.jsonl's step records (a resumed run logs its steps again)."""
    if not metrics.exists():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def wait_for_step(metrics: Path, step: int, processes: list, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in logged_steps(metrics)):
        assert all(p.poll() is None for p in processes), f"a process ended before step {step}"
        assert time.monotonic() < deadline, f"no step {step} in {timeout:.0f}s"
        time.sleep(0.05)


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (torchrun starts its workers in sessions of their own: not in its group)."""
    tree = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            tree += process_tree(int(child))
    return tree


def last_losses(records: list[dict]) -> dict[int, dict]:
    """The last logged record of every step: a step run again after a restart replaces the earlier one."""
    return {r["step"]: r for r in records}


def start_agent(
    args: list[str], port: int, is_host: bool, log: Path, env: dict | None = None, entry=("-m", "titan"), restarts=2
) -> subprocess.Popen:
    """One node's torchrun agent (--nnodes 1:2, one worker, c10d rendezvous on 127.0.0.1, --max-restarts `restarts`)
    training `args` with `entry` (titan, or tests/elastic_kill.py); the rendezvous conf lets a dead node leave
    within seconds."""
    conf = f"last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3,is_host={str(is_host).lower()}"
    launcher = ["torchrun", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", str(restarts),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
                "--rdzv-conf", conf, "--monitor-interval", "0.2"]  # fmt: skip
    return subprocess.Popen(
        [*launcher, *entry, "train", "--config", str(DEBUG_RECIPE), *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **FRESH_STORE, **(env or {})},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
