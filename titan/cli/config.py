"""`titan config show` and `titan config keys`."""

from __future__ import annotations

from pathlib import Path

import typer

from titan.cli.common import CONFIG_OPTION, config_app, preflight, recipe_command
from titan.config import degrees_world_size, describe_stages, read_config, run_stages, to_toml
from titan.errors import ConfigError, UserError
from titan.launcher import Launch


@recipe_command("show", config_app)
def config_show(
    ctx: typer.Context,
    config: Path = CONFIG_OPTION,
    world_size: int = typer.Option(
        None, "--world-size", help="Check for this many processes; default: $WORLD_SIZE, else the recipe's degrees."
    ),
) -> None:
    """Print the fully resolved recipe as TOML.

    Defaults and overrides applied, once it passes what `titan train` checks before it reads any data: the keys,
    the model, the parallel layout and the run plan (and, where the recipe's device is on this machine, what the
    layout asks of it). A recipe in [[data.stages]] ends with each stage's steps and tokens, as TOML comments."""
    if world_size is None:
        launch = Launch.from_env()  # under torchrun: its world; else the one the degrees ask for
        world_size = launch.world if launch.launched else degrees_world_size(read_config(config, ctx.args).parallel)
    cfg = preflight(config, ctx.args, world_size)
    from titan.train.preflight import check_run

    checked = check_run(cfg, world_size, lambda: _device_here(cfg.training.device))
    typer.echo(to_toml(checked.config), nl=False)
    if cfg.data.stages:
        stages = run_stages(cfg, checked.plan.global_rows)
        typer.echo("".join(f"# {line}\n" for line in describe_stages(stages, checked.plan.tokens_per_step)), nl=False)


def _device_here(name: str):
    """The device training.device names, if this machine has it; None: a GPU recipe on a machine without one (a
    login node), whose device checks wait for the run. Asked only by a check that needs the device: torch loads
    here, and takes a while."""
    from titan.train.device import pick_device

    try:
        return pick_device(name)[0]
    except ConfigError:
        return None


@config_app.command("keys")
def config_keys(
    section: str = typer.Argument(None, help="Only this section's keys, e.g. training."),
    markdown: bool = typer.Option(False, "--markdown", help="As Markdown tables, as in docs/config.md."),
) -> None:
    """List every recipe key: its type, default and meaning."""
    import shutil

    from titan.config_keys import keys_markdown, keys_text, recipe_keys

    keys = [k for k in recipe_keys() if section is None or k.name.split(".")[0] == section]
    if not keys:
        sections = sorted({k.name.split(".")[0] for k in recipe_keys()})
        raise UserError(f"no section {section!r}; sections: {', '.join(sections)}")
    width = min(shutil.get_terminal_size().columns, 100)
    typer.echo(keys_markdown(keys) if markdown else keys_text(keys, width), nl=False)
