"""`titan data prepare`, `titan data ls` and `titan data clean`."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import typer

from titan.cli.common import CONFIG_OPTION, data_app, recipe_command
from titan.config import degrees_world_size, load_config, read_config, require_inputs
from titan.errors import UserError


@recipe_command("prepare", data_app)
def data_prepare(
    ctx: typer.Context,
    config: Path = CONFIG_OPTION,
    workers: int = typer.Option(None, "--workers", help="Tokenizer processes; overrides data.prepare_workers."),
    part: str = typer.Option(
        "0/1",
        "--part",
        help="i/N: prepare the i-th (from 0) of N shares of each source's files, for N machines "
        "sharing data.cache_dir; the part that finishes last merges them.",
    ),
) -> None:
    """Tokenize a recipe's sources once into token shards.

    `titan train` finds them there. Prepares data.source (or every [[data.sources]]) and validation.source, if set, into
    data.cache_dir; a source already prepared with the same files and tokenizer is skipped, and an interrupted one
    resumes where it stopped.
    """
    overrides = [*ctx.args, *(["--data.prepare_workers", str(workers)] if workers is not None else [])]
    # Preparing runs anywhere (a login node): the recipe is checked at the world its own degrees make.
    cfg = load_config(config, overrides, world_size=degrees_world_size(read_config(config, overrides).parallel))
    require_inputs(cfg)
    share = _part(part)
    from titan.checkpoint.weights_tokenizer import with_weights_tokenizer
    from titan.data import validation_source
    from titan.data.prepared import cache_root_for, describe, find_prepared, prepare

    cfg = with_weights_tokenizer(cfg)
    cache_root = cache_root_for(cfg.data)
    for source in [*cfg.data.source_list(), *filter(None, [validation_source(cfg)])]:
        start = time.perf_counter()
        done = find_prepared(source, cfg.tokenizer, cache_root)
        path = done or prepare(source, cfg.tokenizer, cache_root, cfg.data.prepare_workers, part=share)
        seconds = time.perf_counter() - start
        if path is None:
            typer.echo(f"{source.source}: part {part} prepared in {seconds:.1f} s; other parts' files remain")
            continue
        meta = json.loads((path / "meta.json").read_text())
        speed = "already prepared" if done else f"{seconds:.1f} s, {meta['tokens'] / seconds:,.0f} tokens/s"
        typer.echo(f"{source.source}: {path}: {describe(meta)}, {speed}")


CACHE_CONFIG_OPTION = typer.Option(
    None, "--config", "-c", help="A recipe whose data.cache_dir to use; default: the titan cache's prepared/."
)


def _prepared_cache(config: Path | None) -> Path:
    from titan.config import Data
    from titan.data.prepared import cache_root_for

    return cache_root_for(read_config(config).data if config else Data())


@data_app.command("ls")
def data_ls(config: Path = CACHE_CONFIG_OPTION) -> None:
    """List the prepared sources in the cache.

    Their size, documents and tokens, and whether each still matches its source (a local source whose files
    changed or are gone can never be read again: `titan data clean --stale`)."""
    from titan.data.prepared import cached_sources, describe

    root = _prepared_cache(config)
    found = cached_sources(root)
    for source in found:
        what = f", {describe(source.meta)}, from {source.meta['source']['source']}" if source.meta else ""
        typer.echo(f"{source.name}: {source.state}, {_gib(source.nbytes)}{what}")
    typer.echo(f"{len(found)} in {root}, {_gib(sum(s.nbytes for s in found))}")


@data_app.command("clean")
def data_clean(
    names: list[str] = typer.Argument(None, help="Folders to remove, as `titan data ls` names them."),
    stale: bool = typer.Option(False, "--stale", help="Remove every folder whose source changed or is gone."),
    unfinished: bool = typer.Option(False, "--unfinished", help="Remove what unfinished preparations left."),
    remove_all: bool = typer.Option(False, "--all", help="Remove every prepared source."),
    config: Path = CACHE_CONFIG_OPTION,
) -> None:
    """Remove prepared sources from the cache.

    A folder that a process is preparing now is left alone."""
    from titan.data.prepared import cached_sources, remove_cached

    if not (names or stale or unfinished or remove_all):
        raise UserError("name the folders to remove (see `titan data ls`), or pass --stale, --unfinished or --all")
    root = _prepared_cache(config)
    found = {source.name: source for source in cached_sources(root)}
    if missing := sorted(set(names or []) - set(found)):
        raise UserError(f"no {', '.join(missing)} in {root}; `titan data ls` lists what is there")
    chosen = [
        source
        for source in found.values()
        if remove_all
        or source.name in (names or [])
        or (stale and source.state not in ("current", "unfinished"))
        or (unfinished and source.state == "unfinished")
    ]
    freed = 0
    for source in chosen:
        if remove_cached(source):
            freed += source.nbytes
            typer.echo(f"removed {source.name} ({source.state}, {_gib(source.nbytes)})")
        else:
            typer.echo(f"kept {source.name}: a process is preparing it now")
    typer.echo(f"freed {_gib(freed)} in {root}")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _part(text: str) -> tuple[int, int]:
    """`--part i/N` as (i, N), 0 <= i < N."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not int(match[1]) < int(match[2]):
        raise UserError(f"--part {text}: give i/N with 0 <= i < N, e.g. --part 0/4 on the first of 4 machines")
    return int(match[1]), int(match[2])
