"""The `titan` command line: train, config show, compare."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from titan.config import ConfigError, load_config, to_toml

app = typer.Typer(
    help="titan: pretrain Llama-family language models from a TOML recipe, on one CPU or thousands of GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect recipes.", no_args_is_help=True)
app.add_typer(config_app, name="config")

# Overrides (--section.key value) are not declared options, so let them through to the recipe loader.
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}
CONFIG_OPTION = typer.Option(..., "--config", "-c", help="The TOML recipe, e.g. recipes/debug.toml.")


# Exit status after a signal-triggered checkpoint: EX_TEMPFAIL, "try again later" (SLURM scripts requeue on it).
PREEMPTED_EXIT_CODE = 75


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=2)


@app.command(context_settings=OVERRIDES)
def train(ctx: typer.Context, config: Path = CONFIG_OPTION) -> None:
    """Train a model from a recipe. Any recipe key can be overridden: --training.steps 30 --optimizer.lr 1e-3.

    Run alone, under `torchrun --nproc-per-node N`, or from a SLURM batch script.
    """
    try:
        cfg = load_config(config, ctx.args)
        from titan.metrics import set_recipe
        from titan.trainer import Trainer  # imported late: torch and friends take a while to import

        set_recipe(config)  # the trackers group runs by recipe
        Trainer(cfg).train()
    except ConfigError as e:
        _fail(str(e))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@config_app.command("show", context_settings=OVERRIDES)
def config_show(ctx: typer.Context, config: Path = CONFIG_OPTION) -> None:
    """Print the fully resolved recipe (defaults and overrides applied) as TOML."""
    try:
        typer.echo(to_toml(load_config(config, ctx.args)), nl=False)
    except ConfigError as e:
        _fail(str(e))


@app.command()
def compare(
    runs: list[Path] = typer.Argument(..., help="Run folders (<job.output_dir>/<job.name>), two or more to compare."),
    plot: Path = typer.Option(None, "--plot", help="Also draw loss vs steps and tokens, and tokens/s, into this PNG."),
) -> None:
    """Compare runs from their folders: a table of loss, throughput, MFU, memory and time, and the config keys that differ.

    Reads only the run folders (config.toml, metrics.jsonl, run_info.json); works offline.
    """
    from titan.compare import CompareError, format_report, load_run
    from titan.compare import plot as draw

    try:
        loaded = [load_run(run) for run in runs]
        typer.echo(format_report(loaded), nl=False)
        if plot is not None:
            typer.echo(f"\nplot: {draw(loaded, plot)}")
    except CompareError as e:
        _fail(str(e))


def main() -> None:
    app(prog_name="titan")


if __name__ == "__main__":
    sys.exit(main())
