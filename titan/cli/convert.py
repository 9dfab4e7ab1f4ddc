"""`titan convert hf-to-dcp`, `titan convert dcp-to-hf` and `titan convert upgrade`, and `titan download`."""

from __future__ import annotations

from pathlib import Path

import typer

from titan.cli.common import app, convert_app


@convert_app.command("hf-to-dcp")
def convert_hf_to_dcp(
    hf_dir: Path = typer.Argument(
        ..., help="A Hugging Face model folder: config.json and *.safetensors (sharded or not)."
    ),
    out_dir: Path = typer.Argument(..., help="The titan checkpoint folder to write (must not exist, or be empty)."),
    model: str = typer.Option(
        "", "--model", help="titan model family (model.name); default: the one that reads config.json's model_type."
    ),
    flavor: str = typer.Option(
        "", "--flavor", help="Express the model as this flavor + overrides; default: the closest."
    ),
) -> None:
    """Write an HF checkpoint as a titan checkpoint.

    The model weights only; prints the recipe lines that load it."""
    from titan.checkpoint.hf import hf_to_dcp  # imported late: torch takes a while to import

    typer.echo(hf_to_dcp(hf_dir, out_dir, model or None, flavor or None))


@convert_app.command("dcp-to-hf")
def convert_dcp_to_hf(
    checkpoint: Path = typer.Argument(
        ..., help="A titan checkpoint (step-N), or a checkpoints/ or run folder: its newest."
    ),
    out_dir: Path = typer.Argument(..., help="The HF model folder to write (must not exist, or be empty)."),
    max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="Largest safetensors file, e.g. 5GB, 500MB."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16 (or float32, bfloat16, float16)."),
    tokenizer: Path = typer.Option(
        None, "--tokenizer", help="A tokenizer.json to export instead of the one the checkpoint's recipe names."
    ),
    push_to_hub: str = typer.Option(
        None, "--push-to-hub", metavar="REPO", help="Then upload the folder to this hub model, e.g. alice/my-model."
    ),
    private: bool = typer.Option(False, "--private", help="With --push-to-hub: create the repository private."),
) -> None:
    """Export a titan checkpoint as an HF model folder.

    The model and tokenizer (config.json, safetensors, tokenizer and generation config), which transformers'
    AutoModelForCausalLM and AutoTokenizer load, and a model card (README.md) of the run.

    --push-to-hub uploads it with the hub credentials found (HF_TOKEN, or hf auth login)."""
    if push_to_hub:
        from titan.tools.upload import check_push, push

        check_push(push_to_hub)  # before the export, which can take long
    from titan.checkpoint.hf import dcp_to_hf  # imported late: torch takes a while to import

    typer.echo(dcp_to_hf(checkpoint, out_dir, max_shard_size, dtype, tokenizer, name=push_to_hub))
    if push_to_hub:
        typer.echo(push(out_dir, push_to_hub, private))


@convert_app.command("upgrade")
def convert_upgrade(
    path: Path = typer.Argument(
        ..., help="A checkpoint of an older titan (step-N), or a checkpoints/ or run folder: all of its checkpoints."
    ),
) -> None:
    """Rewrite an older titan's checkpoints in today's format.

    DCP's pickled .metadata becomes titan's JSON index, in place, once."""
    from titan.checkpoint.format import upgrade
    from titan.checkpoint.resume import checkpoints_at

    for folder in checkpoints_at(path):
        typer.echo(upgrade(folder))


@app.command()
def download(
    name: str = typer.Argument(..., help="A Hugging Face hub model, e.g. meta-llama/Llama-3.2-1B."),
    weights: bool = typer.Option(False, "--weights", help="Also fetch its safetensors weights."),
    revision: str = typer.Option(None, "--revision", help="A branch, tag or commit; default: main."),
) -> None:
    """Fetch a hub model's config and tokenizer for offline use.

    They go (and with --weights its safetensors) into the local HF cache, where titan finds them offline:
    tokenizer.path = NAME, checkpoint.init_from_hf, titan convert hf-to-dcp.

    A gated model needs its terms accepted on the hub and a login (hf auth login, or HF_TOKEN).
    """
    from titan.tools.download import download as fetch

    typer.echo(fetch(name, weights, revision))
