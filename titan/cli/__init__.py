"""The `titan` command line: train, launch, config show, data prepare, tokenizer train, compare, convert, download,
generate, eval, verify, plan, simulate, snapshots.

One module per command group; importing it registers its commands on the apps of titan.cli.common."""

from __future__ import annotations

import importlib.metadata
import os
import re
import signal
import sys

import typer

# Imported in the order `titan --help` lists the commands: the order they register in.
from titan.cli import train, launch, config, data, tokenizer, compare, convert, generate, evaluate  # isort: skip  # noqa: F401
from titan.cli import verify, plan, simulate, snapshots  # isort: skip  # noqa: F401
from titan.cli.common import app
from titan.errors import UserError
from titan.launcher import Launch

# The torch releases titan runs on, [from, to): pyproject.toml's pin, checked again at run time.
TORCH_VERSIONS = ((2, 11), (2, 14))


def _leave_together() -> None:
    """Under torchrun the first rank to exit gets the others killed (exit -15 rather than 2). The ranks stop on
    the same user error, so they meet at a barrier (for at most 30 s) and leave at once."""
    launched = Launch.from_env()
    if not launched.agent or launched.world < 2:
        return
    # torchrun ends the other ranks with SIGTERM once one has exited: they leave on the same error, and exit 2
    # whichever comes first (a busy machine can let the agent's signal arrive before a rank's own exit).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    import datetime

    import torch.distributed as dist

    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    except Exception:  # a rank that never came: leave anyway
        pass
    sys.stderr.flush()
    os._exit(2)  # now, without a teardown that would take longer on one rank than another


def check_torch(version: str | None) -> str | None:
    """Refuse a torch that titan was not written for (`pip install --no-deps` into an image skips pip's check of
    the pin); returns a warning for a torch newer than the tested ones. `version`: torch's, None if not installed."""
    low, high = TORCH_VERSIONS
    wanted = f"torch >= {low[0]}.{low[1]} and < {high[0]}.{high[1]}"
    if version is None:
        raise UserError(f"titan needs {wanted}, and this Python has no torch: install one (e.g. pip install torch)")
    major_minor = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", version).groups())
    if major_minor < low:
        raise UserError(
            f"titan needs {wanted}; this Python has torch {version}: use an image or environment with a newer torch"
        )
    if major_minor >= high:
        return f"titan is tested on {wanted}; this is torch {version}, which may work"
    return None


def _torch_version() -> str | None:
    """The version of the torch that runs: its own, where a program imported it before calling main(); else its
    package's, read without importing it (a refused recipe or `titan --help` never waits for torch's import)."""
    if (torch := sys.modules.get("torch")) is not None:
        return torch.__version__
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    """The `titan` command. A UserError ends it with its message as one line on stderr and exit status 2; under
    torchrun only rank 0 prints (every rank fails alike)."""
    rank_0 = Launch.from_env().rank == 0
    try:
        if warning := check_torch(_torch_version()):
            if rank_0:
                typer.secho(f"warning: {warning}", err=True, fg=typer.colors.YELLOW)
        app(prog_name="titan")
    except UserError as e:
        if rank_0:
            typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        _leave_together()
        sys.exit(2)
    finally:
        dist = sys.modules.get("torch.distributed")  # not imported when the recipe was refused: a quick exit
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
