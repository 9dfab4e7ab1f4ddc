"""`titan verify`."""

from __future__ import annotations

from pathlib import Path

import typer

from titan.cli.common import recipe_command
from titan.errors import ConfigError


@recipe_command()
def verify(
    ctx: typer.Context,
    config: Path = typer.Option(
        None, "--config", "-c", "--job.config_file", help="The TOML recipe, e.g. recipes/debug.toml."
    ),
    steps: int = typer.Option(3, "--steps", help="Training steps to compare."),
    out: Path = typer.Option(None, "--out", help="Folder for the runs; default <output_dir>/verify/<job.name>."),
    reuse_reference: bool = typer.Option(
        False, "--reuse-reference", help="Keep the 1-process runs already in --out if their recipe is the same."
    ),
    replay: int = typer.Option(
        None, "--replay", help="Replay this step of a run (from --checkpoint) on its layout and on another."
    ),
    checkpoint: Path = typer.Option(
        None, "--checkpoint", help="With --replay: the run's checkpoints folder (or its run folder)."
    ),
) -> None:
    """Check a layout against one process, or replay a step of a run.

    Tensor by tensor, naming where it departs: give the layout as overrides, e.g. --parallel.dp_shard 2; the
    processes are started for you. --replay STEP --checkpoint DIR trains a step again, bitwise on the run's layout
    and within tolerance on another (docs/verify.md). Exit status 1 when they differ.
    """
    if replay is not None:
        if checkpoint is None or config is not None:
            raise ConfigError(
                "--replay replays the recipe saved in the run's checkpoint: give --checkpoint DIR (the run's "
                "checkpoints folder) and no --config"
            )
        from titan.tools.verify.replay import replay as run_replay  # imported late: torch takes a while to import

        report, equivalent = run_replay(replay, checkpoint, ctx.args, out)
    else:
        if config is None:
            raise ConfigError("titan verify needs --config RECIPE (or --replay STEP --checkpoint DIR)")
        from titan.tools.verify.runs import verify as run_verify

        report, equivalent = run_verify(config, ctx.args, steps, out, reuse_reference)
    typer.echo(report)
    if not equivalent:
        raise typer.Exit(code=1)
