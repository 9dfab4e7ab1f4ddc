"""In-memory snapshots across nodes: a rank's files stream to its buddy a chunk at a time, and a restore on the
survivors reads from other nodes only the byte ranges its own load needs."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import DEBUG_RECIPE, ROOT, scenarios_beyond, tiny_overrides
from distributed import free_port, run_distributed
from helpers import TINY_MODEL
from titan.checkpoint.snapshots.exchange import exchange
from titan.config import load_config
from titan.train.trainer import Trainer

SIZES = {0: [0, 1, 7, 23], 1: [6, 8, 14], 2: [15]}  # bytes of each rank's files: empty, under, at and over a chunk


def file_bytes(rank: int, i: int, size: int) -> bytes:
    return bytes((rank * 31 + i * 7 + k) % 251 for k in range(size))


def swap_files(root: str) -> dict[str, bytes]:
    """Each rank writes its files, sends them to the next rank in 7-byte chunks and keeps the previous rank's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    own, into = Path(root) / f"own-{rank}", Path(root) / f"copy-{rank}"
    own.mkdir()
    into.mkdir()
    names = []
    for i, size in enumerate(SIZES[rank]):
        names.append(f"r{rank}-{i}")
        (own / names[-1]).write_bytes(file_bytes(rank, i, size))
    exchange(own, names, (rank + 1) % world, (rank - 1) % world, into, None, chunk=7)
    return {p.name: p.read_bytes() for p in into.iterdir()}


@pytest.mark.distributed
def test_files_reach_the_buddy_whole_in_chunks(tmp_path):
    """Three ranks in a ring, files of 0 to 23 bytes in 7-byte chunks, each rank sending a different number of
    chunks than it receives: every file arrives with its bytes."""
    got = run_distributed(swap_files, 3, str(tmp_path))
    for rank in range(3):
        source = (rank - 1) % 3
        expected = {f"r{source}-{i}": file_bytes(source, i, size) for i, size in enumerate(SIZES[source])}
        assert got[rank] == expected


RUN = {**TINY_MODEL, "training.seq_len": "32", "optimizer.lr": "3e-3", "training.global_batch_size": "12",
       "training.steps": "10", "checkpoint.interval": "1000"}  # fmt: skip
FETCHED = re.compile(r"snapshot restore: rank 0 fetched (\d+) of the (\d+) bytes its load reads from other nodes")


def start_nodes(args: list[str], nodes: list[Path], logs: list[Path], restart: int) -> list[subprocess.Popen]:
    """One rank per simulated node (its own shared-memory folder), started as torchrun's workers of restart
    `restart` would be."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(len(nodes)), "LOCAL_WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_MAX_RESTARTS": "1"}  # fmt: skip
    return [
        subprocess.Popen(
            [sys.executable, "-m", "titan", "train", "--config", str(DEBUG_RECIPE), *args],
            cwd=ROOT,
            env={**env, "RANK": str(r), "TITAN_SNAPSHOT_DIR": str(node)},
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
        )  # fmt: skip
        for r, (node, log) in enumerate(zip(nodes, logs))
    ]


def steps_logged(metrics: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {r["step"]: r for r in records if "loss" in r}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "copy_corrupt", scenarios_beyond([False], [False, True]), ids=["restored", "corrupt-copy-refused"]
)
def test_survivors_on_two_nodes_restore_a_lost_node_s_rank_fetching_only_what_they_read(tmp_path, copy_corrupt):
    """Three nodes of one rank each snapshot every step (each rank's files also on the next node). At step 6 every
    worker is killed and node 1's memory is lost; the restart has the ranks of nodes 0 and 2. The lost rank's files
    survive only as node 2's copy, so node 0's new rank reads ranges of them over the network, and only the ranges
    its load reads, less than the snapshot's shards. With one byte of that copy flipped, its hash refuses it in
    one line and the run starts again from the disk (here: nothing). Either way the run goes on to the losses of
    an uninterrupted one-process run, every step's tokens the same, none lost."""
    args = tiny_overrides(tmp_path / "run", **RUN) + ["--fault.snapshot_interval", "1"]
    nodes = [tmp_path / f"node{n}" for n in range(3)]
    for node in nodes:
        node.mkdir()
    metrics = tmp_path / "run" / "debug" / "metrics.jsonl"
    first = start_nodes(args, nodes, [tmp_path / f"first{r}.err" for r in range(3)], restart=0)
    try:
        deadline = time.monotonic() + 180
        while max(steps_logged(metrics), default=0) < 6:
            assert all(p.poll() is None for p in first) and time.monotonic() < deadline, "no step 6"
            time.sleep(0.05)
    finally:
        for p in first:
            p.send_signal(signal.SIGKILL)
            p.wait()
    shutil.rmtree(nodes[1])
    snapshot = max(nodes[0].glob("titan-snapshots-*/snap-*"), key=lambda p: int(p.name.removeprefix("snap-")))
    manifest = json.loads((snapshot / "rank-0" / "snapshot.json").read_text())["files"]
    shards = sum(entry["size"] for name, entry in manifest.items() if name.endswith(".distcp"))  # all three ranks'
    if copy_corrupt:
        (copy,) = nodes[2].glob(f"titan-snapshots-*/{snapshot.name}/rank-1/__1_0.distcp")
        data = bytearray(copy.read_bytes())
        data[len(data) // 2] ^= 1
        copy.write_bytes(data)
    logs = [tmp_path / f"second{r}.err" for r in range(2)]
    second = start_nodes(args, [nodes[0], nodes[2]], logs, restart=1)
    for p, log in zip(second, logs):
        assert p.wait(timeout=300) == 0, log.read_text()[-3000:]
    err = logs[0].read_text()
    refused = [line for line in err.splitlines() if "resuming from the disk checkpoint" in line]
    if copy_corrupt:
        assert len(refused) == 1 and "restoring the in-memory" not in err, err[-3000:]
        step = snapshot.name.removeprefix("snap-")
        assert f"(step {step}'s __1_0.distcp, rank 1's copy on rank 1's node, does not match its SHA-256)" in refused[0]
    else:
        fetched = FETCHED.search(err)
        assert not refused and "restoring the in-memory snapshot" in err and fetched, err[-3000:]
        got, reads = map(int, fetched.groups())
        assert 0 < got < reads < shards, (got, reads, shards)
    reference = tmp_path / "reference"
    Trainer(load_config(DEBUG_RECIPE, tiny_overrides(reference, **RUN))).train()
    expected, logged = steps_logged(reference / "debug" / "metrics.jsonl"), steps_logged(metrics)
    assert sorted(logged) == list(range(1, 11))
    restart = next(json.loads(line) for line in metrics.read_text().splitlines() if "elastic_restart" in line)
    assert restart["world_size"] == 2, restart
    assert restart["step"] == 0 if copy_corrupt else restart["step"] >= 5, restart
    for step in range(1, 11):
        assert logged[step]["tokens_seen"] == expected[step]["tokens_seen"], step
        assert logged[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step
