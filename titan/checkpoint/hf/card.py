"""The model card (README.md) that `titan convert dcp-to-hf` writes beside the weights: Hugging Face's YAML front
matter, then the recipe, the tokens seen and the losses of the checkpoint's run, the tokenizer, and how to load it
with transformers. The facts come from the checkpoint's train_state.json (step, tokens, the step's loss, the
recipe) and, for validation, from the run folder's metrics.jsonl where the checkpoint still sits in its run."""

from __future__ import annotations

import math
from pathlib import Path

from titan.checkpoint.train_state import read_train_state
from titan.schema import parse_toml


def model_card(found, n_params: int, tokenizer, dtype: str, name: str) -> str:
    """README.md for the export of `found` (a ModelCheckpoint) with `tokenizer` (titan's, or None), named `name`
    in its loading example (the hub repository, or the folder)."""
    from huggingface_hub import ModelCardData

    state = read_train_state(found.path)
    recipe = parse_toml(state["recipe"])  # read as saved: a key another titan named otherwise is left out
    family = found.spec.name
    front = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=["titan", family])
    # No license is guessed: the user chooses one for their data and weights before sharing.
    license_hint = "# license: set the license you share these weights under (e.g. apache-2.0, mit, other)"
    step = state["step"]
    lines = [
        f"---\n{front.to_yaml()}\n{license_hint}\n---\n",
        f"# {Path(name).name}\n",
        f"A {family} causal language model of {n_params / 1e6:.2f}M parameters "
        f"{'trained with titan' if step else 'not trained by titan (its weights as converted or initialised)'}, "
        f"exported from its checkpoint at step {step} by `titan convert dcp-to-hf` ({dtype} weights).\n",
        "## Training\n",
        _table(_recipe_rows(recipe, state, n_params, found.args.max_seq_len)),
        "## Results\n",
        _table(_loss_rows(state, found.path)),
    ]
    if tokenizer is not None:
        lines += ["## Tokenizer\n", _tokenizer_text(tokenizer, recipe.get("tokenizer", {}))]
    lines += ["## Use\n", _usage(name)]
    return "\n".join(lines)


def _table(rows: list[tuple[str, str]]) -> str:
    return "| | |\n|---|---|\n" + "".join(f"| {_cell(key)} | {_cell(value)} |\n" for key, value in rows)


def _cell(text: str) -> str:
    """`text` as one Markdown table cell: a `|` or a line break in a recipe's value would end the cell or the row."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _source_name(source: str) -> str:
    """What the card says a data source was: a corpus or hub dataset by its name, a local file or folder by its
    own name, never the path on the machine that trained (a home folder, a user name, a project's layout)."""
    if source.startswith("titan:"):
        return source
    local = source.startswith((".", "/", "~")) or Path(source).suffix != ""
    return Path(source).name if local else source  # no suffix and no leading path: a hub id, org/name


def _data(data: dict) -> str:
    """The sources the run read, weighted in a mixture; of a run in [[data.stages]], each stage's and where it began."""
    stages = data.get("stages") or [{"sources": data.get("sources") or [{"source": data.get("source", "?")}]}]
    described = []
    for i, stage in enumerate(stages):
        sources = stage.get("sources", [])
        weighted = len(sources) > 1
        mixture = ", ".join(
            _source_name(str(s["source"])) + (f" (weight {s.get('weight', 1.0)})" if weighted else "") for s in sources
        )
        name = stage.get("name") or f"stage{i}"
        after = (
            f"{stage['start_tokens']:,} tokens" if stage.get("start_tokens") else f"{stage.get('start_step', 0)} steps"
        )
        described.append(mixture if len(stages) == 1 else f"{name}{f' after {after}' if i else ''}: {mixture}")
    return "; ".join(described)


def _recipe_rows(recipe: dict, state: dict, n_params: int, context: int) -> list[tuple[str, str]]:
    """What was trained, on what and how: the recipe's math, not its layout (which changes no number here)."""
    model, data, training = recipe.get("model", {}), recipe.get("data", {}), recipe.get("training", {})
    overrides = ", ".join(f"{key} = {value}" for key, value in model.get("overrides", {}).items())
    rows = [
        ("model", f"{model.get('name')}, flavor {model.get('flavor')}" + (f" ({overrides})" if overrides else "")),
        ("parameters", f"{n_params:,}"),
    ]
    trained_at = training.get("seq_len")
    if state["step"] == 0 or not trained_at:  # the recipe's training keys are defaults that trained nothing
        rows.append(("context length", f"{context:,} tokens"))
    else:  # the positions the model takes are not what it learned: a run at 256 tokens saw no longer context
        rows.append(("context length", f"trained at {trained_at:,} tokens (positions up to {context:,})"))
    if state["step"] == 0:
        return rows
    rows.append(("data", _data(data)))
    batch = state.get("math", {}).get("training.global_batch")  # as resolved for the run's layout
    if batch:
        rows.append(("batch", f"{batch} sequences of {training.get('seq_len')} tokens"))
    rows += [
        ("optimizer", _optimizer(recipe.get("optimizer", {}), recipe.get("lr_scheduler", {}))),
        ("precision", str(training.get("mixed_precision", "fp32"))),
        ("steps", str(state["step"])),
        ("tokens seen", f"{state.get('tokens_seen', 0):,}"),
    ]
    start = recipe.get("checkpoint", {}).get("init_from_hf")
    if start:
        rows.append(("started from", f"the Hugging Face weights {start}"))
    return rows


def _optimizer(optimizer: dict, schedule: dict) -> str:
    """e.g. 'adamw, lr 0.003, weight decay 0.1; 20 warmup steps, cosine decay to 0.1 x lr'."""
    warmup = schedule.get("warmup_steps", 0)
    decay = schedule.get("decay", "cosine")
    after = "constant lr" if decay == "constant" else f"{decay} decay to {schedule.get('min_lr_ratio')} x lr"
    return (
        f"{optimizer.get('name', 'adamw')}, lr {optimizer.get('lr')}, weight decay {optimizer.get('weight_decay')}; "
        f"{f'{warmup} warmup step' + 's' * (warmup > 1) if warmup else 'no warmup'}, {after}"
    )


def _loss_rows(state: dict, path: Path) -> list[tuple[str, str]]:
    """The checkpoint step's training loss, and the last and best validation losses logged up to that step."""
    step = state["step"]
    if step == 0:
        return [("training", "none in titan (step 0)")]
    loss = state.get("loss")
    rows = [(f"final training loss (step {step})", "not finite" if loss is None else f"{loss:.4f}")]
    validation = _validation(path.parent.parent, step)
    if not validation:
        return rows + [("validation loss", "none logged (validation.interval = 0, or no metrics.jsonl in the run)")]
    last, best = max(validation), min(validation, key=validation.get)
    return rows + [
        (f"final validation loss (step {last})", f"{validation[last]:.4f}"),
        (f"best validation loss (step {best})", f"{validation[best]:.4f}"),
    ]


def _validation(run_dir: Path, step: int) -> dict[int, float]:
    """{step: validation loss} of the run folder's metrics.jsonl, up to `step` (a later checkpoint's run went on
    past it); empty where the checkpoint is not in its run folder."""
    from titan.observe.runs import read_metrics

    try:
        records = read_metrics(run_dir / "metrics.jsonl")
    except (OSError, ValueError):
        return {}
    return {
        r["step"]: r["val_loss"]
        for r in records
        if "val_loss" in r and r["step"] <= step and math.isfinite(r["val_loss"])
    }


def _tokenizer_text(tokenizer, section: dict) -> str:
    """The exported tokenizer: its size and special tokens (as the recipe names them, whichever file was read)."""
    bos, eos = section.get("bos_token"), section.get("eos_token")
    if tokenizer.bos_id is None:
        return (
            f"`tokenizer.json`, {tokenizer.vocab_size:,} tokens; no BOS, EOS `{eos}` ({tokenizer.eos_id}), which "
            "also pads. titan trained on documents framed text + EOS, as the tokenizer encodes them.\n"
        )
    return (
        f"`tokenizer.json`, {tokenizer.vocab_size:,} tokens; BOS `{bos}` ({tokenizer.bos_id}), EOS `{eos}` "
        f"({tokenizer.eos_id}), which also pads. titan trained on documents framed BOS + text + EOS, so the "
        "tokenizer prepends BOS to what it encodes.\n"
    )


def _usage(name: str) -> str:
    return f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{name}", padding_side="left")  # left: batches for generate
model = AutoModelForCausalLM.from_pretrained("{name}")
inputs = tokenizer(["Once upon a time", "The dog ran"], return_tensors="pt", padding=True)
outputs = model.generate(**inputs, max_new_tokens=32, do_sample=False)
print(tokenizer.batch_decode(outputs, skip_special_tokens=True))
```
"""
