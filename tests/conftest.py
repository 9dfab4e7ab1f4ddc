import functools
import multiprocessing
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import forked_cli
import pytest

from titan.launcher import run_local_ranks

# One OpenMP thread per process: the xdist workers, and the ranks and CLI runs of their tests, already run side by
# side on every core, and more threads than cores spin waiting for each other (the whole suite took 10% longer on 2
# cores with torch's default of a thread per core). A value the user sets stands.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles in a pool of worker processes by default; a test process that forks distributed workers
# (tests/distributed.py) after a compile would hand them that pool's state, and their own compiles hang.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Prepared token shards (and fetched corpora) of this test session, shared by its processes and CLI runs.
os.environ.setdefault("TITAN_CACHE", tempfile.mkdtemp(prefix="titan-test-cache-"))
# The tiny runs several tests read (tests/runs.py), trained once per session: a folder of this session's own, set
# before the xdist workers start so that they share it (a TITAN_CACHE the user set outlives the code that trained).
os.environ.setdefault("TITAN_TEST_RUNS", tempfile.mkdtemp(prefix="titan-test-runs-"))

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


def pytest_collection_modifyitems(items):
    """The files with the most slow tests first: xdist hands out whole files in this order, and a long file handed
    out last runs alone at the end while the other workers sit idle."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])


# Variables read when a module is imported (the import profiler, huggingface_hub's endpoint, cache and offline
# flags): a run that sets one needs an interpreter of its own, since the forkserver imported everything already.
_READ_AT_IMPORT = ("PYTHON", "HF_")


def run_titan(
    *args: str, env: dict | None = None, timeout: float = 600, fresh: bool | None = None, cwd: Path = ROOT, script=None
):
    """Run the real CLI (`titan ARGS`) in `cwd` (the repository root by default), as a user would: the same entry
    point, exit status, stdout and stderr as `python -m titan`. The process is forked from a server that imported
    torch and this checkout's titan once (about 4 s saved per run); `fresh`, or by default an environment variable
    read at import, starts a new interpreter instead (fresh=False: the variable is for the processes the run
    starts). `script`: a test's wrapper of the entry point, run in titan's place (`python SCRIPT ARGS`)."""
    full_env = {**os.environ, **(env or {})}
    if fresh is None:
        fresh = any(key.startswith(_READ_AT_IMPORT) for key in env or {})
    if fresh:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
        entry = [script] if script else ["-m", "titan"]
        return subprocess.run([sys.executable, *entry, *args], cwd=cwd, env=full_env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="titan-cli-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        work = (list(args), full_env, str(cwd), str(out), str(err), script)
        child = _forkserver().Process(target=forked_cli.titan_main, args=work)
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["titan", *args], timeout, _text(out), _text(err))
        if child.exitcode == 255:  # multiprocessing's mark for a status the forkserver failed to report: run again
            return run_titan(*args, env=env, timeout=timeout, fresh=True, cwd=cwd, script=script)
        return subprocess.CompletedProcess(["titan", *args], child.exitcode, _text(out), _text(err))


def run_titan_ranks(
    world: int, *args: str, env: dict | None = None, timeout: float = 600, script: str | None = None
) -> subprocess.CompletedProcess:
    """`titan ARGS` on `world` local ranks forked from run_titan's server, as titan.launcher.run_local_ranks starts
    them (the environment torchrun gives its workers, one OpenMP thread; the others stopped once one fails): the same
    entry point and process group as `torchrun --nproc-per-node WORLD -m titan ARGS`, without an interpreter per rank
    and the agent's (4 s of imports each). The result's exit status is the first failed rank's (else 0), its streams
    every rank's in rank order. Tests of the launch itself, and runs that set a variable read at import, run the real
    torchrun (below). `script`: a test's wrapper of the entry point, run in titan's place (`torchrun ... SCRIPT
    ARGS`)."""
    if any(key.startswith(_READ_AT_IMPORT) for key in env or {}):
        return torchrun(world, list(args), env=env, timeout=timeout, script=script)
    shared = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="titan-ranks-") as tmp:
        streams = [(Path(tmp) / f"out{r}", Path(tmp) / f"err{r}") for r in range(world)]

        def args_of(rank: int, rank_env: dict) -> tuple:
            return list(args), {**shared, **rank_env}, str(ROOT), *map(str, streams[rank]), script

        try:
            failed = run_local_ranks(_forkserver(), forked_cli.titan_main, args_of, world, timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(["titan", *args], timeout) from None
        texts = [(_text(out), _text(err)) for out, err in streams]
    return subprocess.CompletedProcess(
        ["titan", *args], failed, "".join(out for out, _ in texts), "".join(err for _, err in texts)
    )


def torchrun(
    world: int, args: list[str], env: dict | None = None, timeout: float = 600, script: str | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node WORLD -m titan ARGS` (or `... SCRIPT ARGS`), as a user would start it."""
    from distributed import free_port

    entry = [script] if script else ["-m", "titan"]
    command = ["torchrun", "--nproc-per-node", str(world), "--master-port", str(free_port()), *entry, *args]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _text(path: Path) -> str:
    """What a forked run wrote to a stream; empty where it died before opening it."""
    return path.read_text() if path.exists() else ""


def run_titan_many(runs: list[tuple[list[str], dict]], workers: int = 3) -> list[subprocess.CompletedProcess]:
    """run_titan(*args, env=env) for each (args, env) of `runs`, `workers` at a time; the results in order."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda run: run_titan(*run[0], env=run[1]), runs))


@functools.cache
def _forkserver():
    context = multiprocessing.get_context("forkserver")
    # typer's parameter parsing imports pydantic on first use, torch's exit handler tabulate, and a training run its
    # model family and data reader: 0.3 s, 0.1 s and 0.25 s in every child unless the server holds them (a preload
    # that no longer exists is skipped).
    preload = ["torch", "titan.cli", "titan.train.trainer", "typer._adapters", "tabulate", "forked_cli"]
    preload += [f"titan.models.{family}.{module}" for family in ("llama", "moe") for module in ("model", "hf")]
    preload += ["titan.models.decoder.parallelize", "titan.data.prepared", "titan.data.stages", "titan.optim.muon"]
    context.set_forkserver_preload(preload)
    return context


def scenarios_beyond(default, values) -> list:
    """Parameters for pytest.mark.parametrize: each of `values` (a tuple for several names), those not in `default`
    under the scenario marker (python -m pytest -m scenario runs them; the default run keeps the others)."""
    scenario = lambda v: pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.scenario)  # noqa: E731
    return [value if value in default else scenario(value) for value in values]


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


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Where the time went, per test file (setup, call and teardown summed; the workers run files side by side), so
    that a slow machine shows what to trim. --durations=25 (pyproject.toml) lists the slowest tests above it."""
    if len(_FILE_SECONDS) < 2:
        return
    terminalreporter.write_sep("=", "time per test file (the slowest 25)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}s  in all, {len(_FILE_SECONDS)} files")
