"""`titan verify`."""

from __future__ import annotations

from pathlib import Path

import typer

from titan.cli.common import CONFIG_OPTION, recipe_command


@recipe_command()
def verify(
    ctx: typer.Context,
    config: Path = CONFIG_OPTION,
    steps: int = typer.Option(3, "--steps", help="Training steps to compare."),
    out: Path = typer.Option(None, "--out", help="Folder for the runs; default <output_dir>/verify/<job.name>."),
    reuse_reference: bool = typer.Option(
        False, "--reuse-reference", help="Keep the 1-process runs already in --out if their recipe is the same."
    ),
) -> None:
    """Check that a parallel layout trains as one process does.

    Tensor by tensor, naming where it departs. Give the layout as overrides, e.g. --parallel.dp_shard 2 --parallel.tp 2;
    the processes are started for you. Exit status 1 when the layout is not equivalent.
    """
    from titan.tools.verify.runs import verify as run_verify  # imported late: torch takes a while to import

    report, equivalent = run_verify(config, ctx.args, steps, out, reuse_reference)
    typer.echo(report)
    if not equivalent:
        raise typer.Exit(code=1)
