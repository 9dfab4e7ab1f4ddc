import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Inductor compiles in a pool of worker processes by default; a test process that forks distributed workers
# (tests/distributed.py) after a compile would hand them that pool's state, and their own compiles hang.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Prepared token shards (and fetched corpora) of this test session, shared by its processes and CLI runs.
os.environ.setdefault("TITAN_CACHE", tempfile.mkdtemp(prefix="titan-test-cache-"))

ROOT = Path(__file__).resolve().parents[1]
DEBUG_RECIPE = ROOT / "recipes" / "debug.toml"


def run_titan(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real CLI (`python -m titan ...`) from the repository root, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "titan", *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def tiny_overrides(tmp_path: Path, **extra) -> list[str]:
    """Overrides that make the debug recipe quick: a small model, short sequences, no trackers."""
    values = {
        "job.output_dir": str(tmp_path),
        # The project's own generated corpus and tokenizer: no download.
        "data.source": "data/stories.jsonl",
        "tokenizer.path": "data/tokenizer.json",
        "validation.interval": "0",
        "metrics.wandb": "disabled",
        "metrics.tensorboard": "false",
        "metrics.log_freq": "1",
        "metrics.peak_flops": "1e11",
        "training.seq_len": "64",
        "training.global_batch_size": "0",  # local_batch_size x data-parallel size, as each test sets them
        "training.local_batch_size": "4",
        "lr_scheduler.warmup_steps": "1",  # the recipe's 20 would outlast most tests' runs
        **extra,
    }
    return [item for key, value in values.items() for item in (f"--{key}", value)]


@pytest.fixture(autouse=True)
def _repo_root_cwd(monkeypatch):
    # Recipes name data/ and tokenizer paths relative to the repository root.
    monkeypatch.chdir(ROOT)
