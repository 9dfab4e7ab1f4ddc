"""`titan tokenizer train`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from titan.cli.common import OVERRIDES, RecipeCommand, tokenizer_app
from titan.config import parse_overrides, read_config
from titan.errors import UserError
from titan.files import write_error


@tokenizer_app.command(
    "train", cls=RecipeCommand, context_settings=OVERRIDES, options_metavar="[OPTIONS] [--section.key VALUE]..."
)
def tokenizer_train(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", "-o", help="The tokenizer.json to write (in it, if a folder)."),
    data: str = typer.Option(
        None, "--data", help="The text to train on: any data.source (a file, a folder, a hub dataset); sets it."
    ),
    vocab_size: int = typer.Option(32000, "--vocab-size", help="Tokens in the vocabulary, BOS and EOS included."),
    min_frequency: int = typer.Option(2, "--min-frequency", help="Merge only pairs seen at least this often."),
    config: Path = typer.Option(
        None, "--config", "-c", help="A recipe whose data sources and tokenizer.bos_token/eos_token to use."
    ),
) -> None:
    """Train a byte-level BPE tokenizer on a data source.

    The source is read as training reads it (data.format, data.text_field, data.text_unit, as overrides or from
    --config); BOS and EOS (tokenizer.bos_token and eos_token) get ids 0 and 1. Set tokenizer.path to the file it
    writes."""
    overrides = [*ctx.args, *(["--data.source", data] if data is not None else [])]
    if config is None and not {key for key, _ in parse_overrides(overrides)} & {"data.source", "data.sources"}:
        raise UserError("give the text to train on: --data SOURCE (a file or folder), or --config RECIPE")
    cfg = read_config(config, overrides)
    if out.is_dir():
        out = out / "tokenizer.json"
    from titan.data.train_tokenizer import train_on_sources  # imported late: reading may import HF datasets

    special = (cfg.tokenizer.bos_token, cfg.tokenizer.eos_token)
    if not special[0]:
        raise UserError("tokenizer.bos_token is empty: titan tokenizer train gives BOS id 0; name a BOS token")
    trained = train_on_sources(cfg.data.source_list(), vocab_size, min_frequency, sys.stderr.isatty(), special)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(trained.tokenizer.to_str(pretty=True))
    except OSError as e:
        raise UserError(f"--out {out}: cannot write it: {write_error(e)}") from None
    size = trained.tokenizer.get_vocab_size()
    # BPE stops when no pair is seen --min-frequency times: a small corpus learns fewer tokens than asked.
    short = (
        f" of the {vocab_size:,} asked: the corpus has no more pairs seen {min_frequency}+ times"
        if size < vocab_size
        else ""
    )
    typer.echo(
        f"wrote {out}: {size:,} tokens{short} ({special[0]} = 0, {special[1]} = 1), trained on "
        f'{trained.documents:,} documents of {trained.characters:,} characters; set tokenizer.path = "{out}"'
    )
