"""`titan plan`, and its --cp, --ep and --graph modes."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from titan.cli.common import CONFIG_OPTION, recipe_command
from titan.config import degrees_world_size, load_config, read_config
from titan.errors import ConfigError, UserError


@recipe_command()
def plan(
    ctx: typer.Context,
    config: Path = CONFIG_OPTION,
    world_size: int = typer.Option(None, "--world-size", help="Devices the run uses; default: the recipe's degrees."),
    device: str = typer.Option(None, "--device", help="h100, h200, a100 or mi300x (plan.device)."),
    json_path: Path = typer.Option(None, "--json", help="Also write the figures to this JSON file."),
    graph: bool = typer.Option(
        False, "--graph", help="Instead: one block's operator order and memory layouts, traced and reordered."
    ),
    cp: str = typer.Option(
        None,
        "--cp",
        help="Instead: compare cp degrees, e.g. 1,2,4.",
    ),
    ep: str = typer.Option(
        None,
        "--ep",
        help="Instead: compare ep degrees, e.g. 1,2,8.",
    ),
) -> None:
    """Check that a recipe fits its devices; predict its step time.

    Before launching it, on this CPU: one step of each pipeline rank, built and parallelised as for training, is traced
    under fake tensors on a fake process group of the run's world size. Prints a table per pipeline rank; exit status 1
    when a rank's peak (with --cp or --ep: every degree) does not fit.
    """
    overrides = [*ctx.args, *(["--plan.device", device] if device else [])]
    if world_size is None:
        p = read_config(config, overrides).parallel
        world_size = degrees_world_size(p)
        if p.dp_shard == -1:  # it takes what the world size leaves: plan the smallest world
            typer.echo(f"planned on {world_size} device{'s' * (world_size > 1)} (parallel.dp_shard = -1 and no "
                       "--world-size; give --world-size to plan a bigger world)")  # fmt: skip
    if cp is not None and ep is not None:
        raise UserError("give --cp or --ep, not both: each compares the degrees of one dimension")
    dimension, text = ("cp", cp) if cp is not None else ("ep", ep)
    degrees = _degrees(dimension, text) if text is not None else []
    if degrees and graph:
        raise UserError(f"give --{dimension} or --graph, not both: --{dimension} plans whole steps, --graph one block")
    cfg = load_config(config, overrides, world_size=world_size)
    if graph and cfg.parallel.cp > 1:
        share = cfg.training.seq_len // cfg.parallel.cp
        raise UserError(
            f"--graph traces one block on whole rows with plain attention, not a parallel.cp rank's share; to see a "
            f"block at that share, give --parallel.cp 1 --training.seq_len {share}"
        )
    from titan.train.estimate.estimate import estimate_step  # imported late: torch takes a while to import
    from titan.train.estimate.graph import analyse_recipe
    from titan.train.estimate.report import estimate_json, format_estimate, format_graph, shortfall

    if degrees:
        _compare(config, overrides, world_size, dimension, degrees, json_path)
        return
    if graph:
        analysis, what = analyse_recipe(cfg, world_size)
        typer.echo(format_graph(analysis, what))
        if json_path is not None:
            json_path.write_text(json.dumps(analysis.as_json(), indent=2) + "\n")
        return
    result = estimate_step(cfg, world_size)
    typer.echo(format_estimate(result))
    if json_path is not None:
        json_path.write_text(json.dumps(estimate_json(result), indent=2) + "\n")
    short = shortfall(result)
    if short:
        typer.secho(f"error: {short}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=1)


def _compare(
    config: Path, overrides: list[str], world_size: int, dimension: str, degrees: list[int], json_path: Path | None
) -> None:
    """`titan plan --cp` or `--ep`: the recipe planned at each degree of `dimension` on the same devices; exit status 1
    when none fits."""
    from titan.train.estimate.estimate import estimate_step
    from titan.train.estimate.report import estimate_json, format_comparison, shortfall

    plans = {}
    for degree in degrees:
        # cp takes its ranks from dp_shard, which takes what each degree leaves; ep shares dp_shard x cp.
        layout = [f"--parallel.{dimension}", str(degree), *(["--parallel.dp_shard", "-1"] * (dimension == "cp"))]
        try:
            plans[degree] = estimate_step(load_config(config, [*overrides, *layout], world_size=world_size), world_size)
        except ConfigError as e:  # a degree the recipe cannot be cut into: its line says why
            plans[degree] = str(e)
    typer.echo(format_comparison(dimension, plans, world_size))
    if json_path is not None:
        by_degree = {d: {"error": p} if isinstance(p, str) else estimate_json(p) for d, p in plans.items()}
        json_path.write_text(json.dumps({dimension: by_degree}, indent=2) + "\n")
    if not any(not isinstance(p, str) and shortfall(p) is None for p in plans.values()):
        raise typer.Exit(code=1)


def _degrees(dimension: str, text: str) -> list[int]:
    """`titan plan --cp 1,2,4,8` (or --ep): the degrees to compare."""
    try:
        degrees = [int(item) for item in text.split(",")]
    except ValueError:
        degrees = []
    if not degrees or min(degrees) < 1:
        kind = {"cp": "context", "ep": "expert"}[dimension]
        raise UserError(
            f"--{dimension} {text}: give {kind}-parallel degrees separated by commas, e.g. --{dimension} 1,2,4,8"
        )
    return sorted(set(degrees))
