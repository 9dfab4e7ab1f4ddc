"""`titan compare`."""

from __future__ import annotations

from pathlib import Path

import typer

from titan.cli.common import app
from titan.errors import UserError


@app.command()
def compare(
    runs: list[Path] = typer.Argument(..., help="Run folders (<job.output_dir>/<job.name>), two or more to compare."),
    plot: Path = typer.Option(
        None,
        "--plot",
        help="Also draw loss (and validation loss), lr, grad norm, tokens/s and MFU into this .png, .svg or .pdf.",
    ),
    x_axis: str = typer.Option("steps", "--x-axis", help="The plot's x axis: steps or tokens (seen)."),
) -> None:
    """Compare runs side by side from their folders.

    A table of loss, throughput, MFU, memory and time, and the config keys that differ. Reads only the run folders
    (config.toml, metrics.jsonl, run_info.json); works offline.
    """
    from titan.tools.compare import X_AXES, format_report, load_run, plot_format
    from titan.tools.compare import plot as draw

    if x_axis not in X_AXES:
        raise UserError(f"--x-axis {x_axis!r}: choose {' or '.join(X_AXES)}")
    if plot is not None:
        plot_format(plot)  # before the report: a bad --plot is the whole command's error
    loaded = [load_run(run) for run in runs]
    typer.echo(format_report(loaded), nl=False)
    if plot is not None:
        typer.echo(f"\nplot: {draw(loaded, plot, x_axis)}")
