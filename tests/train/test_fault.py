"""Faults: a hung rank becomes a failure that names it (the watchdog), and under torchrun's elastic agent a run
that loses a node goes on on the survivors with the uninterrupted run's losses."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DEBUG_RECIPE, ROOT, tiny_overrides
from distributed import free_port
from helpers import TINY_MODEL

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


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stopped_rank_is_named_by_the_other_within_the_step_timeout(tmp_path):
    """Two ranks as torchrun starts them; rank 1 is SIGSTOPped at step 3. Rank 0 waits in a collective, and its
    watchdog ends it within fault.step_timeout_s (plus a beat) with one line naming rank 1 as silent."""
    timeout_s = 5
    args = tiny_overrides(tmp_path, **{**RUN, "training.steps": "1000", "checkpoint.enable": "false"})
    args += ["--fault.step_timeout_s", str(timeout_s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    logs = [tmp_path / f"rank{r}.err" for r in range(2)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "titan", "train", "--config", str(DEBUG_RECIPE), *args],
            cwd=ROOT,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=logs[r].open("w"),
        )
        for r in range(2)
    ]
    try:
        wait_for_step(tmp_path / "debug" / "metrics.jsonl", 3, ranks)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        ranks[0].wait(timeout=60)
        detected = time.monotonic() - stopped
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    err = logs[0].read_text()
    print(f"hang detected {detected:.1f}s after the SIGSTOP (fault.step_timeout_s = {timeout_s})")
    assert ranks[0].returncode == 1, err[-3000:]
    hung = [line for line in err.splitlines() if "hung at step" in line]
    assert len(hung) == 1 and "Traceback" not in err, err[-3000:]
    assert hung[0].startswith("titan: rank 0 hung at step ") and "waiting for rank 1 (silent for" in hung[0], hung
    assert detected < timeout_s + 3, hung
