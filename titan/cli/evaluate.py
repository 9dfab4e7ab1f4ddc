"""`titan eval`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from titan.cli.common import app
from titan.config import read_config
from titan.errors import UserError
from titan.files import write_error


@app.command("eval")
def evaluate(  # noqa: PLR0913 (a command's options)
    checkpoint: Path = typer.Option(
        ..., "--checkpoint", help="A titan checkpoint (step-N), or a checkpoints/ or run folder: its newest."
    ),
    data: str = typer.Option(
        None, "--data", help="Score the perplexity on this source: a file, a folder or a hub dataset, as data.source."
    ),
    text_unit: str = typer.Option("file", "--text-unit", help="For .txt files: file, paragraph or line, as data."),
    text_field: str = typer.Option("text", "--text-field", help="The field that holds the text, as data.text_field."),
    split: str = typer.Option("validation", "--split", help="A hub or saved dataset's split."),
    seq_len: int = typer.Option(0, "--seq-len", help="Tokens per scored sequence; 0: the recipe's training.seq_len."),
    batches: int = typer.Option(0, "--batches", help="Score at most this many batches; 0: the whole source."),
    tokens: int = typer.Option(0, "--tokens", help="Score about this many tokens (whole batches); 0: all."),
    tasks: str = typer.Option(
        None, "--tasks", help="Run these lm-eval-harness tasks, comma-separated, e.g. hellaswag,arc_easy."
    ),
    include_path: Path = typer.Option(None, "--include-path", help="A folder of your own task YAML files."),
    allow_task_code: bool = typer.Option(
        False, "--allow-task-code", help="Run the Python that --include-path's task files name (!function)."
    ),
    limit: float = typer.Option(None, "--limit", help="Documents per task (below 1: a fraction); for a quick look."),
    num_fewshot: int = typer.Option(None, "--num-fewshot", help="Examples in each prompt; default: the task's."),
    batch_size: int = typer.Option(0, "--batch-size", help="Sequences per forward; 0: the recipe's local batch."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32 or bf16 (or float32, bfloat16): the weights' dtype."),
    output: Path = typer.Option(None, "--output", help="Also write the results to this JSON file."),
) -> None:
    """Score a checkpoint's perplexity or benchmark tasks.

    --data scores the held-out perplexity as training's validation does; --tasks runs lm-eval-harness tasks (the
    [eval] extra) on the model directly. Each prints its results; --output writes them as JSON."""
    if data is None and tasks is None:
        raise UserError("give --data SOURCE (perplexity on your data) or --tasks NAMES (lm-eval-harness), or both")
    task_names = [name.strip() for name in (tasks or "").split(",") if name.strip()]
    if tasks is not None and not task_names:
        raise UserError("--tasks names no task; give lm-eval task names, comma-separated, e.g. --tasks hellaswag")
    # Checked before the model loads: the source's keys as a recipe types them.
    source = None
    if data is not None:
        overrides = ["--data.source", data, "--data.text_unit", text_unit, "--data.text_field", text_field]
        source = read_config(None, [*overrides, "--data.split", split]).data.source_list()[0]
    from titan.train import harness  # imported late: torch is slow to import

    if task_names:
        code = harness.task_code(task_names, include_path)
        if code and not allow_task_code:  # checked before anything is loaded or imported
            more = f" and {len(code) - 1} more" if len(code) > 1 else ""
            raise UserError(f"--tasks: a task file is code, and these run Python: {code[0]}{more}; read it, then "
                            "pass --allow-task-code to run it")  # fmt: skip
        harness.go_offline_for_local_tasks(task_names, include_path)  # before anything imports HF datasets
    from titan.checkpoint.hf import checkpoint_tokenizer
    from titan.dtypes import parse_dtype
    from titan.tools.generate import DTYPES, device_and_mesh, load_model
    from titan.tools.perplexity import Limits, perplexity

    limits = Limits(seq_len, batch_size, batches, tokens)
    limits.check()
    loaded = load_model(checkpoint, device_and_mesh(1)[0], DTYPES[parse_dtype(dtype, DTYPES)])
    results = {}
    if source is not None:
        scored = perplexity(loaded, source, limits)
        typer.echo(scored.line())
        results["perplexity"] = {"source": data, "loss": scored.loss, "perplexity": scored.perplexity,
                                 "tokens": scored.tokens, "seq_len": scored.seq_len}  # fmt: skip
    if task_names:
        tokenizer = checkpoint_tokenizer(loaded.checkpoint.path, loaded.model.args.vocab_size)
        lm = harness.lm_class()(loaded.model.eval(), tokenizer, batch_size or 8)
        found = harness.run_tasks(lm, task_names, harness.task_manager(task_names, include_path), limit, num_fewshot)
        from lm_eval.utils import make_table

        typer.echo(make_table(found))
        results["tasks"] = found["results"]
    if output is not None:
        try:
            output.write_text(json.dumps(results, indent=2, default=str) + "\n")
        except OSError as e:
            raise UserError(f"--output {output}: cannot write it: {write_error(e)}") from None
