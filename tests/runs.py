"""Tiny training runs that several tests read, each trained once per test session: on disk in the session's
TITAN_TEST_RUNS folder (conftest.py; the xdist workers share it), keyed by the run's overrides, and trained by the
first worker that asks while the others wait on a file lock. A run is read-only to its readers: a test that changes
files copies the folder first (shutil.copytree)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from filelock import FileLock

from conftest import DEBUG_RECIPE, tiny_overrides
from helpers import SMALL


def trained_run(**extra: str) -> Path:
    """The folder (holding `debug/`: checkpoints, metrics.jsonl, ...) of a one-process `titan train` of the debug
    recipe with the tests' tiny overrides, SMALL and `extra`."""
    from titan.config import load_config
    from titan.train.trainer import Trainer

    values = {**SMALL, **extra}
    key = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(os.environ["TITAN_TEST_RUNS"])
    folder, done = root / key, root / f"{key}.done"
    with FileLock(root / f"{key}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a run a crashed worker left half-trained
            Trainer(load_config(DEBUG_RECIPE, tiny_overrides(folder, **values))).train()
            done.write_text(json.dumps(values, indent=1))
    return folder
