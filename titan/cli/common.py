"""What the command groups share: the root `titan` app and its groups, the recipe option and its overrides, and
the pre-flight check of a recipe."""

from __future__ import annotations

from pathlib import Path

import typer

from titan import __version__
from titan.config import Config, load_config, require_inputs, run_stages
from titan.config.checks import warn_of_a_wasted_schedule
from titan.errors import Mistakes
from titan.launcher import Launch
from titan.run_plan import run_plan
from titan.train.model import resolve_args, warn_of_an_impossible_export

app = typer.Typer(
    help="titan: pretrain Llama-family language models from a TOML recipe, on one CPU or thousands of GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain: recipe keys such as [[data.sources]] keep their brackets
)
config_app = typer.Typer(help="Inspect recipes.", no_args_is_help=True)
app.add_typer(config_app, name="config")
convert_app = typer.Typer(
    help="Convert checkpoints between titan and Hugging Face.\n\ntitan's are DCP, Hugging Face's safetensors.",
    no_args_is_help=True,
)
app.add_typer(convert_app, name="convert")
data_app = typer.Typer(help="Prepare data: tokenize sources once into token shards.", no_args_is_help=True)
app.add_typer(data_app, name="data")
simulate_app = typer.Typer(help="Simulate clusters larger than this machine.", no_args_is_help=True)
app.add_typer(simulate_app, name="simulate")
snapshots_app = typer.Typer(help="In-memory snapshots left in host shared memory.", no_args_is_help=True)
app.add_typer(snapshots_app, name="snapshots")
tokenizer_app = typer.Typer(help="Train a tokenizer on your data.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"titan {__version__}")
        raise typer.Exit()


@app.callback()
def _titan(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print titan's version and exit."
    ),
) -> None:
    pass  # the options of `titan` itself; its help is the app's


# Overrides (--section.key value) are not declared options, so let them through to the recipe loader.
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}
# --job.config_file is the name torchtitan users type.
CONFIG_OPTION = typer.Option(
    ..., "--config", "-c", "--job.config_file", help="The TOML recipe, e.g. recipes/debug.toml."
)

OVERRIDES_HELP = (
    "Recipe keys: each overrides the recipe as --section.key VALUE (or --section.key=VALUE). A list is "
    '"[1, 2]" (of strings, also a,b); a key alone means true; --model.overrides.n_layers 2 sets one model field. '
    "Most used: --training.steps, --training.global_batch_size, --training.local_batch_size, --training.seq_len, "
    "--optimizer.lr, --job.name, --parallel.dp_shard, --parallel.tp, --parallel.pp. One section: titan config keys "
    "SECTION; all of them as a table: docs/config.md."
)


class RecipeCommand(typer.core.TyperCommand):
    """A command that takes recipe overrides: its help ends with every recipe key, by section."""

    def format_epilog(self, ctx, formatter) -> None:
        import textwrap

        from titan.config_keys import keys_text, recipe_keys

        intro = textwrap.fill(OVERRIDES_HELP, formatter.width)
        formatter.write(f"\n{intro}\n\n{keys_text(recipe_keys(), formatter.width, flag='--')}")


def recipe_command(name: str | None = None, group: typer.Typer = app):
    """A command of `group` that takes a recipe and its overrides."""
    return group.command(
        name, cls=RecipeCommand, context_settings=OVERRIDES, options_metavar="[OPTIONS] [--section.key VALUE]..."
    )


def preflight(path: Path, overrides: list[str], world_size: int | None = None) -> Config:
    """The recipe, loaded and checked, and its run plan checked at the world size torchrun gives (1 alone): a
    recipe that cannot run is refused here, before torch is imported."""
    world_size = world_size or Launch.from_env().world
    mistakes = Mistakes()  # every mistake of the recipe in one report, its model's and inputs' included
    config = load_config(path, overrides, world_size, mistakes)
    with mistakes.gather():
        require_inputs(config)
    if not any(str(e).startswith("model.") for e in mistakes.found):  # else said already
        with mistakes.gather():
            args = resolve_args(config)
    if not mistakes.found:  # the run plan and the stages of a recipe whose values are right
        # The stages' order needs the run's global batch: checked here, before the run joins its process group.
        with mistakes.gather():
            stages = run_stages(config, run_plan(config, world_size).global_rows)
    mistakes.raise_any()
    warn_of_a_wasted_schedule(config, stages)
    warn_of_an_impossible_export(config, args)
    return config
