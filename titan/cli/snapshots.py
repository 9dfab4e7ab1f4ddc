"""`titan snapshots ls` and `titan snapshots clean`: this user's in-memory snapshot folders in host shared memory."""

from __future__ import annotations

import typer

from titan.checkpoint.snapshots.folder import Held, held_folders, release, shared_memory
from titan.cli.common import snapshots_app
from titan.errors import UserError


def _state(held: Held) -> str:
    if held.owner is None:
        return "unknown (no owner.json titan can read)"
    agent = f"agent {held.owner['pid']} on {held.owner['host']}"
    return f"{agent}, gone" if held.gone else f"{agent}, running or on another host"


def _mib(size: int) -> str:
    return f"{size / 2**20:.3g} MiB"


@snapshots_app.command("ls")
def snapshots_ls() -> None:
    """List your snapshot folders in host shared memory.

    Each with its size, the steps it holds, its run folder and whether the torchrun agent that made it still runs.
    Host shared memory is $TITAN_SNAPSHOT_DIR, else /dev/shm."""
    memory = shared_memory()
    found = held_folders(memory) if memory.is_dir() else []
    for held in found:
        run = held.owner["run"].split("|")[0] if held.owner else "?"
        steps = ", ".join(map(str, held.steps)) or "none"
        typer.echo(f"{held.folder.name}: {_mib(held.size)}, steps {steps}, run {run}, {_state(held)}")
    typer.echo(f"{len(found)} in {memory}, {_mib(sum(held.size for held in found))}")


@snapshots_app.command("clean")
def snapshots_clean(
    names: list[str] = typer.Argument(None, help="Folders to remove, as `titan snapshots ls` names them."),
    gone: bool = typer.Option(False, "--gone", help="Remove every folder whose agent no longer runs."),
) -> None:
    """Remove snapshot folders from host shared memory.

    A run removes its own when it ends, and a start on the host those of agents that are gone; this is for what a
    crash leaves elsewhere. Remove a named folder only once its run has ended: its restarts resume from it."""
    if not (names or gone):
        raise UserError("name the folders to remove (see `titan snapshots ls`), or pass --gone")
    memory = shared_memory()
    found = {held.folder.name: held for held in (held_folders(memory) if memory.is_dir() else [])}
    if missing := sorted(set(names or []) - set(found)):
        raise UserError(f"no {', '.join(missing)} of yours in {memory}; `titan snapshots ls` lists what is there")
    chosen = [held for name, held in found.items() if name in (names or []) or (gone and held.gone)]
    for held in chosen:
        release(held.folder)
        typer.echo(f"removed {held.folder.name} ({_mib(held.size)}, {_state(held)})")
    typer.echo(f"{len(chosen)} removed from {memory}, {_mib(sum(held.size for held in chosen))} of host memory freed")
