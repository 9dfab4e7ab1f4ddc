import multiprocessing
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# Inductor compiles in a pool of worker processes by default; a test process that forks distributed workers
# (tests/distributed.py) after a compile would hand them that pool's state, and their own compiles hang.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Prepared token shards (and fetched corpora) of this test session, shared by its processes and CLI runs.
os.environ.setdefault("TITAN_CACHE", tempfile.mkdtemp(prefix="titan-test-cache-"))

ROOT = Path(__file__).resolve().parents[1]
DEBUG_RECIPE = ROOT / "recipes" / "debug.toml"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (no test paths named) runs on up to 4 pytest-xdist workers, one test file each: a serial run
    leaves a third of the CPU idle while single-process tests import torch and wait on their subprocesses. Named
    files, `-s`, `-n` and `-p no:xdist` run as asked."""
    if (
        config.pluginmanager.has_plugin("xdist")
        and "PYTEST_XDIST_WORKER" not in os.environ
        and config.args_source != pytest.Config.ArgsSource.ARGS
        and config.option.numprocesses is None
        and config.option.capture != "no"
        and not config.option.collectonly
        and (os.cpu_count() or 1) > 1
    ):
        config.option.numprocesses = min(4, os.cpu_count())
        config.option.dist = "loadfile"


def run_titan(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real CLI (`python -m titan ...`) from the repository root, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "titan", *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def _titan_in_this_process(args: list[str], env: dict, out: str, err: str) -> None:
    """A forked child's body: the CLI's entry point with this process's stdout and stderr going to files."""
    os.chdir(ROOT)
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        with open(path, "wb") as f:
            os.dup2(f.fileno(), fd)
    sys.argv = ["titan", *args]
    from titan.cli import main

    code = 1
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()  # as the interpreter would print it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_titan_forked(runs: list[tuple[list[str], dict]], tmp: Path, workers: int = 3) -> list:
    """Like :func:`run_titan` for many runs, each in its own process forked from a server that imported torch and
    titan once (~5 s saved per run): the same entry point, exit status, stdout and stderr as `python -m titan`."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "titan.cli", "titan.train.trainer"])

    def one(i: int) -> subprocess.CompletedProcess:
        args, env = runs[i]
        out, err = tmp / f"run{i}.out", tmp / f"run{i}.err"
        child = context.Process(target=_titan_in_this_process, args=(args, env, str(out), str(err)))
        child.start()
        child.join(600)
        if child.is_alive():
            child.kill()
        if child.exitcode == 255:  # multiprocessing's mark for a status the forkserver failed to report: run again
            return run_titan(*args, env=env)
        return subprocess.CompletedProcess(args, child.exitcode, out.read_text(), err.read_text())

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(len(runs))))


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
