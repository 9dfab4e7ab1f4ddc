"""The processes of a recorded run (runs.py and replay.py start them), forked from one server process that imported
torch and titan once: a run then starts in a fork, not in an interpreter that imports them again (about 4 s of a CPU
core per process, and `titan verify` starts four). Several processes are started as torchrun starts its workers
(titan.launcher.run_local_ranks)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from titan.config import load_config
from titan.errors import UserError
from titan.launcher import run_local_ranks
from titan.tools.verify.recording import record, replay_run

# What the server imports once: the CLI (a child imports the entry point's module again), and the trainer.
PRELOAD = ["titan.cli", "titan.train.trainer", "titan.tools.verify.processes"]


def run_ranks(recipe: Path, what: tuple[str, int], processes: int, log: Path) -> int:
    """Record the recipe on `processes` local ranks, `what` being ("steps", N) from the start, ("floor", N) the same
    with rounding noise (recording.add_rounding_noise), or ("until", STEP) from its checkpoint (a replay); every
    rank writes to `log`. Returns the first failed rank's exit status, else 0."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    # The user's thread count stands: a replay compared bitwise must compute as the run did.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // processes))

    def args_of(_rank_index: int, env: dict) -> tuple:
        return str(recipe), what, {**env, "OMP_NUM_THREADS": threads}, str(log)

    return run_local_ranks(context, _rank, args_of, processes)


def _rank(recipe: str, what: tuple[str, int], env: dict, log: str) -> None:
    """A forked rank's body: the run's environment and threads, its output into the log."""
    os.environ.update(env)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # the server read OMP_NUM_THREADS when it imported torch
    with open(log, "ab") as out:
        for fd in (1, 2):
            os.dup2(out.fileno(), fd)
    sys.exit(_recorded_run(recipe, what))


def _recorded_run(recipe: str, what: tuple[str, int]) -> int:
    """One rank of a recorded run; returns its exit status (2 with the error's line for a user's error)."""
    kind, step = what
    try:
        if kind == "until":
            replay_run(load_config(recipe), step)
        else:
            record(load_config(recipe), step, rounding_noise=kind == "floor")
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
