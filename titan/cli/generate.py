"""`titan generate`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from titan.cli.common import app
from titan.errors import UserError
from titan.launcher import Launch


@app.command()
def generate(
    checkpoint: Path = typer.Option(
        ..., "--checkpoint", help="A titan checkpoint (step-N), or a checkpoints/ or run folder: its newest."
    ),
    prompt: list[str] = typer.Option(
        None, "--prompt", metavar="<text>", help="The text to continue; repeat it for several prompts."
    ),
    prompts_file: Path = typer.Option(
        None, "--prompts-file", help="A text file of prompts, one per line (blank lines are skipped)."
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Stop after this many tokens (or at EOS)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; above: sample, flatter as it grows."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k likeliest tokens only; 0: from all."),
    top_p: float = typer.Option(
        1.0, "--top-p", help="Sample from the likeliest tokens that make up this probability (nucleus); 1: from all."
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds the sampling, so a run repeats."),
    tokenizer: Path = typer.Option(None, "--tokenizer", help="A tokenizer.json instead of the recipe's."),
    dtype: str = typer.Option(
        "fp32", "--dtype", help="fp32 or bf16 (or float32, bfloat16): the weights are loaded in this dtype."
    ),
    tp: int = typer.Option(
        1, "--tp", help="Tensor-parallel shards, one per process: run under torchrun --nproc-per-node N --tp N."
    ),
    batch_size: int = typer.Option(0, "--batch-size", help="Prompts decoded together; 0: all of them at once."),
) -> None:
    """Continue prompts with a checkpoint's model.

    With a KV cache: the text on stdout (one JSON line per prompt when there are several), the loading and speed
    on stderr."""
    prompts = list(prompt or [])
    if any(not text for text in prompts):
        raise UserError("--prompt is empty; give the text to continue")
    if prompts_file is not None:
        try:
            prompts += [line for line in prompts_file.read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--prompts-file {prompts_file}: cannot read it ({e.__class__.__name__}: {e})") from None
    if not prompts:
        where = f"--prompts-file {prompts_file} has no prompt" if prompts_file else "no prompt"
        raise UserError(f"{where}; give --prompt TEXT or --prompts-file FILE")
    from titan.tools.generate import Loading, Sampling, continue_texts, report  # imported late: torch is slow to import

    rank_0 = Launch.from_env().rank == 0
    texts, generation, loaded = continue_texts(
        checkpoint,
        prompts,
        max_new_tokens,
        Sampling(temperature, top_k, top_p, seed),
        tokenizer_path=tokenizer,
        loading=Loading(dtype, tp, progress=rank_0 and sys.stderr.isatty()),  # a bar on a terminal only, from one rank
        batch_size=batch_size,
    )
    if not rank_0:
        return
    if len(prompts) == 1:
        typer.echo(texts[0])
    else:
        for given, text in zip(prompts, texts):
            typer.echo(json.dumps({"prompt": given, "text": text}, ensure_ascii=False))
    typer.echo(report(loaded, generation), err=True)
