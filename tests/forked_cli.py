"""The body of a CLI run that tests/conftest.py's run_titan forks from its server. A module of its own, importing
nothing heavy, because every forked child imports the module of its target: from conftest that was pytest, 0.3 s a
run."""

import atexit
import os
import runpy
import sys


def titan_main(args: list[str], env: dict, cwd: str, out: str, err: str, script: str | None = None) -> None:
    """A forked child's body: the CLI's entry point in the run's environment and folder, with stdout and stderr
    going to files. Its exit status is main()'s (multiprocessing turns a SystemExit into it, and prints any other
    exception's traceback as the interpreter would); the exit handlers run as an interpreter's do. `script`: a file
    run as `python SCRIPT ARGS` runs it (a test's wrapper around the entry point) instead of the CLI."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # torch read it when the server imported it
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, path in ((1, out), (2, err)):
        with open(path, "wb") as f:
            os.dup2(f.fileno(), fd)
    sys.argv = [script or "titan", *args]
    from titan.cli import main

    try:
        runpy.run_path(script, run_name="__main__") if script else main()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
