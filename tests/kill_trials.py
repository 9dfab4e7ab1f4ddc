"""kill -9 at random moments of a run that checkpoints every step, then resume: run as
`python tests/kill_trials.py ROOT TRIALS SEED`, prints one JSON report.

Torch and titan are imported once here; each run is a forked child (no interpreter start-up per run), so
twenty trials take about a minute. Children use one thread: this process never starts an OpenMP pool that a
fork could inherit half-made."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # this checkout's titan, whatever is installed
os.chdir(ROOT)

import torch  # noqa: E402

torch.set_num_threads(1)

from helpers import trainer_for  # noqa: E402
from titan.checkpoint.format import read_manifest, verify  # noqa: E402
from titan.checkpoint.resume import complete_checkpoints  # noqa: E402

STEPS = 12
RUN = {"training.steps": str(STEPS), "checkpoint.interval": "1", "checkpoint.keep_latest_k": "3"}


def in_child(root: Path, extra: dict) -> int:
    """Fork a child that trains the run in `root`; returns its PID."""
    pid = os.fork()
    if pid == 0:
        try:
            trainer_for(root, **{**RUN, **extra}).train()
            os._exit(0)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
    return pid


def run_to_end(root: Path, extra: dict) -> float:
    start = time.perf_counter()
    _, status = os.waitpid(in_child(root, extra), 0)
    assert os.waitstatus_to_exitcode(status) == 0, root
    return time.perf_counter() - start


def content(folder: Path) -> dict:
    """What a checkpoint holds, comparable across run folders: the tensor files and the loader state byte for
    byte (by their hashes), and the train state but for the paths in its recipe."""
    files = read_manifest(folder)
    state = json.loads((folder / "train_state.json").read_text())
    return {
        "files": {n: e["sha256"] for n, e in files.items() if n.endswith(".distcp") or n == "data.json"},
        "train_state": {k: state[k] for k in ("step", "tokens_seen", "loss", "lr_scheduler", "model", "math")},
    }


def losses(root: Path) -> dict[int, float]:
    """The last logged loss of every step (a resumed run logs its steps again)."""
    found = {}
    for line in (root / "debug" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            found[record["step"]] = record["loss"]
    return found


def main(root: Path, trials: int, seed: int) -> dict:
    reference_root = root / "reference"
    # Keep every checkpoint of the reference: the content each step's save must have.
    duration = run_to_end(reference_root, {"checkpoint.keep_latest_k": "0"})
    reference = {s: content(p) for s, p in complete_checkpoints(reference_root / "debug" / "checkpoints").items()}
    reference_losses = losses(reference_root)
    rng = random.Random(seed)
    report = {"reference_seconds": duration, "trials": []}
    for trial in range(trials):
        trial_root = root / f"trial-{trial}"
        extra = {"checkpoint.async_save": "true"} if trial % 2 else {}
        delay = rng.uniform(0, 0.75 * duration)  # the run itself ends a little before `duration`
        pid = in_child(trial_root, extra)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        folder = trial_root / "debug" / "checkpoints"
        during_save = any(folder.glob(".tmp-step-*"))  # killed while a checkpoint was being written
        accepted, rejected, differing = [], [], []
        for step, path in complete_checkpoints(folder).items():
            if verify(path) is None:
                accepted.append(step)
                if content(path) != reference[step]:
                    differing.append(step)
            else:
                rejected.append(step)
        resumed_from = max(accepted, default=0)
        run_to_end(trial_root, extra)
        got = losses(trial_root)
        report["trials"].append(
            {
                "delay": round(delay, 3),
                "async": bool(extra),
                "during_save": during_save,
                "accepted": accepted,
                "rejected": rejected,
                "differing": differing,
                "resumed_from": resumed_from,
                "losses_equal": all(got[s] == reference_losses[s] for s in range(resumed_from + 1, STEPS + 1)),
            }
        )
    return report


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
