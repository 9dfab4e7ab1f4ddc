"""What the tests of elastic runs share: torchrun agents started as nodes, and the steps their runs logged."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import DEBUG_RECIPE, ROOT
from helpers import TINY_MODEL
from titan.cli.launch import ENVIRONMENT, torchrun_line

# What titan launch gives torchrun's agent: each restart a store of its own, where no dead worker's address is left.
FRESH_STORE = ENVIRONMENT
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
    args: list[str], port: int, is_host: bool, log: Path, env: dict | None = None, entry=None, restarts=2, nnodes="1:2"
) -> subprocess.Popen:
    """One node's agent as the docs start it: `titan launch --nnodes NNODES --rdzv 127.0.0.1:PORT` (one worker, c10d
    rendezvous, the store on the `is_host` node, --max-restarts `restarts`) training `args`. `entry`: a script that
    torchrun runs in titan's place (tests/elastic_kill.py), on the torchrun line titan launch prints."""
    train = ["train", "--config", str(DEBUG_RECIPE), *args]
    if entry is None:
        command = [sys.executable, "-m", "titan", "launch", "--nnodes", nnodes, "--rdzv", f"127.0.0.1:{port}",
                   "--rdzv-id", "elastic", "--max-restarts", str(restarts),
                   "--store-host" if is_host else "--no-store-host", *train]  # fmt: skip
    else:
        line = torchrun_line(nnodes, 1, f"127.0.0.1:{port}", "elastic", restarts, is_host, 100, train)
        command = [sys.executable, "-m", "torch.distributed.run", *line[: line.index("-m")], *entry, *train]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **ENVIRONMENT, **(env or {})},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
