"""The processes of a recorded run (runs.py and replay.py start them), forked from one server process that imported
torch and titan once: a run then starts in a fork, not in an interpreter that imports them again (about 4 s of a CPU
core per process, and `titan verify` starts four). Several processes get the environment torchrun gives its workers,
with the store hosted here as torchrun's agent hosts it; as torchrun does, the other ranks are stopped once one
fails."""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from titan.config import load_config
from titan.errors import UserError
from titan.tools.verify.recording import record, replay_run

# What the server imports once: the CLI (a child imports the entry point's module again), and the trainer.
PRELOAD = ["titan.cli", "titan.train.trainer", "titan.tools.verify.processes"]


def run_ranks(recipe: Path, what: tuple[str, int], processes: int, log: Path) -> int:
    """Record the recipe on `processes` local ranks, `what` being ("steps", N) from the start or ("until", STEP) from
    its checkpoint (a replay); every rank writes to `log`. Returns the first failed rank's exit status, else 0."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    # The user's thread count stands: a replay compared bitwise must compute as the run did.
    shared = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // processes))}
    store = None
    if processes > 1:  # port 0: the system picks a free one, so runs side by side never race for it
        store = dist.TCPStore("127.0.0.1", 0, processes, is_master=True, wait_for_workers=False)
        shared |= {"WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="titan-verify-") as statuses:
        ranks = []
        for rank in range(processes):
            env = {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)} if store else shared
            status = Path(statuses) / str(rank)
            ranks.append(context.Process(target=_rank, args=(str(recipe), what, env, str(log), str(status))))
            ranks[-1].start()
        try:
            while not first_failure(ranks, statuses) and any(rank.is_alive() for rank in ranks):
                time.sleep(0.05)
        finally:
            for rank in ranks:
                rank.kill()  # the ranks left: a failed rank's peers, waiting in a collective (or all, on Ctrl-C)
                rank.join()
        return first_failure(ranks, statuses)


def first_failure(ranks: list, statuses: str) -> int:
    """The first ended rank's status that is not 0. A rank writes it to a file as it ends: multiprocessing's own
    report from the forkserver is lost under load (CPython issue 140867), read as 255."""
    for rank, process in enumerate(ranks):
        if process.exitcode is None:
            continue
        written = Path(statuses) / str(rank)
        status = int(written.read_text()) if written.is_file() else process.exitcode
        if status:
            return status
    return 0


def _rank(recipe: str, what: tuple[str, int], env: dict, log: str, status: str) -> None:
    """A forked rank's body: the run's environment and threads, its output into the log, its exit status
    written before it ends."""
    os.environ.update(env)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # the server read OMP_NUM_THREADS when it imported torch
    with open(log, "ab") as out:
        for fd in (1, 2):
            os.dup2(out.fileno(), fd)
    code = 1
    try:
        code = _recorded_run(recipe, what)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        Path(status).write_text(str(code))
    sys.exit(code)


def _recorded_run(recipe: str, what: tuple[str, int]) -> int:
    """One rank of a recorded run; returns its exit status (2 with the error's line for a user's error)."""
    kind, step = what
    try:
        (record if kind == "steps" else replay_run)(load_config(recipe), step)
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
