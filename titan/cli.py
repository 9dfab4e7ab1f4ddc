"""The `titan` command line: train, config show, data prepare, compare, convert, download, generate."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import sys
import time
from pathlib import Path

import typer

from titan import __version__
from titan.config import Config, degrees_world_size, load_config, read_config, to_toml
from titan.errors import ConfigError, UserError
from titan.files import WRITE_ERRORS, write_error
from titan.run_plan import run_plan

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
    help="Convert checkpoints between titan (DCP) and Hugging Face (safetensors).", no_args_is_help=True
)
app.add_typer(convert_app, name="convert")
data_app = typer.Typer(help="Prepare data: tokenize sources once into token shards.", no_args_is_help=True)
app.add_typer(data_app, name="data")
simulate_app = typer.Typer(help="Simulate clusters larger than this machine.", no_args_is_help=True)
app.add_typer(simulate_app, name="simulate")


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


# The torch releases titan runs on, [from, to): pyproject.toml's pin, checked again at run time.
TORCH_VERSIONS = ((2, 11), (2, 14))

# Exit status after a signal-triggered checkpoint: EX_TEMPFAIL, "try again later" (SLURM scripts requeue on it).
PREEMPTED_EXIT_CODE = 75


def _preflight(path: Path, overrides: list[str], world_size: int | None = None) -> Config:
    """The recipe, loaded and checked, and its run plan checked at the world size torchrun gives (1 alone): a
    recipe that cannot run is refused here, before torch is imported."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    config = load_config(path, overrides, world_size)
    run_plan(config, world_size)
    return config


def _leave_together() -> None:
    """Under torchrun the first rank to exit gets the others killed (exit -15 rather than 2). The ranks stop on
    the same user error, so they meet at a barrier (for at most 30 s) and leave at once."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    import datetime

    import torch.distributed as dist

    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    except Exception:  # a rank that never came: leave anyway
        pass
    sys.stderr.flush()
    os._exit(2)  # now, without a teardown that would take longer on one rank than another


@recipe_command()
def train(ctx: typer.Context, config: Path = CONFIG_OPTION) -> None:
    """Train a model from a recipe, e.g. titan train -c recipes/debug.toml --training.steps 30 --optimizer.lr 1e-3.

    Run alone, under `torchrun --nproc-per-node N`, or from a SLURM batch script. Every recipe key is listed
    below the options, with its type, default and meaning.
    """
    try:
        cfg = _preflight(config, ctx.args)
        from titan.train.stop import Preempted  # imported late: torch and friends take a while to import
        from titan.train.trainer import Trainer

        if cfg.activation_checkpoint.mode == "auto" and not cfg.activation_checkpoint.budget_gib:
            cfg = _with_device_budget(cfg)
        try:
            Trainer(cfg).train()
        except Preempted as e:
            typer.echo(f"titan: {e}", err=True)
            raise typer.Exit(code=PREEMPTED_EXIT_CODE) from None
    except OSError as e:  # a full, read-only or forbidden disk is the machine's state: one line, not a traceback
        if e.errno not in WRITE_ERRORS:
            raise
        raise UserError(write_error(e)) from None


def _with_device_budget(config: Config) -> Config:
    """activation_checkpoint.budget_gib = 0: the budget that this rank's device leaves, as `titan plan` works it out."""
    from titan.observe.metrics import setup_logging
    from titan.tools.plan.estimate import with_activation_budget
    from titan.train.build import device_memory, pick_device

    setup_logging(int(os.environ.get("RANK", "0")))
    device, _ = pick_device(config.training.device)
    return with_activation_budget(config, int(os.environ.get("WORLD_SIZE", "1")), device_memory(device))


@recipe_command("show", config_app)
def config_show(
    ctx: typer.Context,
    config: Path = CONFIG_OPTION,
    world_size: int = typer.Option(
        None, "--world-size", help="Check for this many processes; default: $WORLD_SIZE, else the recipe's degrees."
    ),
) -> None:
    """Print the fully resolved recipe (defaults and overrides applied) as TOML, once it passes what `titan train`
    checks before it reads any data: the keys, the model, the parallel layout and the run plan (and, where the
    recipe's device is on this machine, what the layout asks of it)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", 0)) or degrees_world_size(read_config(config, ctx.args).parallel)
    cfg = _preflight(config, ctx.args, world_size)
    from titan.train.build import check_run, pick_device  # imported late: torch takes a while to import

    try:
        device, _ = pick_device(cfg.training.device)
    except ConfigError:  # a GPU recipe on a machine without one (a login node): the device's checks wait for the run
        device = None
    check_run(cfg, world_size, device)
    typer.echo(to_toml(cfg), nl=False)


@config_app.command("keys")
def config_keys(
    section: str = typer.Argument(None, help="Only this section's keys, e.g. training."),
    markdown: bool = typer.Option(False, "--markdown", help="As Markdown tables, as in docs/config.md."),
) -> None:
    """Every recipe key: its type, default and what it does."""
    import shutil

    from titan.config_keys import keys_markdown, keys_text, recipe_keys

    keys = [k for k in recipe_keys() if section is None or k.name.split(".")[0] == section]
    if not keys:
        sections = sorted({k.name.split(".")[0] for k in recipe_keys()})
        raise UserError(f"no section {section!r}; sections: {', '.join(sections)}")
    width = min(shutil.get_terminal_size().columns, 100)
    typer.echo(keys_markdown(keys) if markdown else keys_text(keys, width), nl=False)


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
    """Tokenize a recipe's sources once into token shards, where `titan train` finds them.

    Prepares data.source (or every [[data.sources]]) and validation.source, if set, into data.cache_dir; a source
    already prepared with the same files and tokenizer is skipped, and an interrupted one resumes where it stopped.
    """
    overrides = [*ctx.args, *(["--data.prepare_workers", str(workers)] if workers is not None else [])]
    # Preparing runs anywhere (a login node): the recipe is checked at the world its own degrees make.
    cfg = load_config(config, overrides, world_size=degrees_world_size(read_config(config, overrides).parallel))
    share = _part(part)
    from titan.data import validation_source  # imported late, as in train: titan.data imports torch
    from titan.data.prepared import cache_root_for, describe, find_prepared, prepare

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
    """List the prepared sources in the cache: size, documents and tokens, and whether each still matches its
    source (a local source whose files changed or are gone can never be read again: `titan data clean --stale`)."""
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
    """Remove prepared sources from the cache; a folder that a process is preparing now is left alone."""
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


@app.command()
def compare(
    runs: list[Path] = typer.Argument(..., help="Run folders (<job.output_dir>/<job.name>), two or more to compare."),
    plot: Path = typer.Option(
        None,
        "--plot",
        help="Also draw loss (and validation loss), lr, grad norm, tokens/s and MFU into this .png, .svg or .pdf.",
    ),
    x_axis: str = typer.Option("steps", "--x-axis", help="The plot's x axis: steps or tokens (seen)."),
) -> None:
    """Compare runs from their folders: a table of loss, throughput, MFU, memory and time, and the config keys
    that differ.

    Reads only the run folders (config.toml, metrics.jsonl, run_info.json); works offline.
    """
    from titan.tools.compare import X_AXES, format_report, load_run, plot_format
    from titan.tools.compare import plot as draw

    if x_axis not in X_AXES:
        raise UserError(f"--x-axis {x_axis!r}: choose {' or '.join(X_AXES)}")
    if plot is not None:
        plot_format(plot)  # before the report: a bad --plot is the whole command's error
    loaded = [load_run(run) for run in runs]
    typer.echo(format_report(loaded), nl=False)
    if plot is not None:
        typer.echo(f"\nplot: {draw(loaded, plot, x_axis)}")


@convert_app.command("hf-to-dcp")
def convert_hf_to_dcp(
    hf_dir: Path = typer.Argument(
        ..., help="A Hugging Face model folder: config.json and *.safetensors (sharded or not)."
    ),
    out_dir: Path = typer.Argument(..., help="The titan checkpoint folder to write (must not exist, or be empty)."),
    model: str = typer.Option("llama3", "--model", help="titan model family (model.name)."),
    flavor: str = typer.Option(
        "", "--flavor", help="Express the model as this flavor + overrides; default: the closest."
    ),
) -> None:
    """Write an HF checkpoint as a titan checkpoint (model weights only), and print the recipe lines that load it."""
    from titan.checkpoint.hf import hf_to_dcp  # imported late: torch takes a while to import

    typer.echo(hf_to_dcp(hf_dir, out_dir, model, flavor or None))


@convert_app.command("dcp-to-hf")
def convert_dcp_to_hf(
    checkpoint: Path = typer.Argument(
        ..., help="A titan checkpoint (step-N), or a checkpoints/ or run folder: its newest."
    ),
    out_dir: Path = typer.Argument(..., help="The HF model folder to write (must not exist, or be empty)."),
    max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="Largest safetensors file, e.g. 5GB, 500MB."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    tokenizer: Path = typer.Option(
        None, "--tokenizer", help="A tokenizer.json to export instead of the one the checkpoint's recipe names."
    ),
) -> None:
    """Export a titan checkpoint's model and tokenizer as an HF folder (config.json, safetensors, tokenizer and
    generation config) that transformers' AutoModelForCausalLM and AutoTokenizer load."""
    from titan.checkpoint.hf import dcp_to_hf

    typer.echo(dcp_to_hf(checkpoint, out_dir, max_shard_size, dtype, tokenizer))


@convert_app.command("upgrade")
def convert_upgrade(
    path: Path = typer.Argument(
        ..., help="A checkpoint of an older titan (step-N), or a checkpoints/ or run folder: all of its checkpoints."
    ),
) -> None:
    """Rewrite checkpoints of an older titan (DCP's pickled .metadata) to titan's JSON index, in place, once."""
    from titan.checkpoint.checkpointer import checkpoints_at
    from titan.checkpoint.format import upgrade

    for folder in checkpoints_at(path):
        typer.echo(upgrade(folder))


@app.command()
def download(
    name: str = typer.Argument(..., help="A Hugging Face hub model, e.g. meta-llama/Llama-3.2-1B."),
    weights: bool = typer.Option(False, "--weights", help="Also fetch its safetensors weights."),
    revision: str = typer.Option(None, "--revision", help="A branch, tag or commit; default: main."),
) -> None:
    """Fetch a hub model's config and tokenizer (and with --weights its safetensors) into the local HF cache,
    where titan finds them offline: tokenizer.path = NAME, checkpoint.init_from_hf, titan convert hf-to-dcp.

    A gated model needs its terms accepted on the hub and a login (hf auth login, or HF_TOKEN).
    """
    from titan.tools.download import download as fetch

    typer.echo(fetch(name, weights, revision))


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
    dtype: str = typer.Option("fp32", "--dtype", help="fp32 or bf16: the weights are loaded in this dtype."),
    tp: int = typer.Option(
        1, "--tp", help="Tensor-parallel shards, one per process: run under torchrun --nproc-per-node N --tp N."
    ),
    batch_size: int = typer.Option(0, "--batch-size", help="Prompts decoded together; 0: all of them at once."),
) -> None:
    """Continue prompts with a checkpoint's model, using a KV cache: the text on stdout (one JSON line per prompt
    when there are several), the loading and speed on stderr."""
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
    from titan.tools.generate import Sampling, continue_texts, report  # imported late: torch takes a while to import

    rank_0 = os.environ.get("RANK", "0") == "0"
    texts, generation, loaded = continue_texts(
        checkpoint,
        prompts,
        max_new_tokens,
        Sampling(temperature, top_k, top_p, seed),
        tokenizer_path=tokenizer,
        dtype=dtype,
        tp=tp,
        batch_size=batch_size,
        progress=rank_0 and sys.stderr.isatty(),  # a bar on a terminal only, from one rank
    )
    if not rank_0:
        return
    if len(prompts) == 1:
        typer.echo(texts[0])
    else:
        for given, text in zip(prompts, texts):
            typer.echo(json.dumps({"prompt": given, "text": text}, ensure_ascii=False))
    typer.echo(report(loaded, generation), err=True)


@recipe_command()
def verify(
    ctx: typer.Context,
    config: Path = CONFIG_OPTION,
    steps: int = typer.Option(3, "--steps", help="Training steps to compare."),
    out: Path = typer.Option(None, "--out", help="Folder for the runs; default <output_dir>/verify/<job.name>."),
    reuse_reference: bool = typer.Option(
        False, "--reuse-reference", help="Keep the 1-process runs already in --out if their recipe is the same."
    ),
) -> None:
    """Check that a parallel layout trains as one process does, tensor by tensor, and name where it departs.

    Give the layout as overrides, e.g. --parallel.dp_shard 2 --parallel.tp 2; the processes are started for you.
    Exit status 1 when the layout is not equivalent.
    """
    from titan.tools.verify.runs import verify as run_verify  # imported late: torch takes a while to import

    report, equivalent = run_verify(config, ctx.args, steps, out, reuse_reference)
    typer.echo(report)
    if not equivalent:
        raise typer.Exit(code=1)


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
        help="Instead: compare these cp degrees, e.g. 1,2,4,8 (dp_shard takes what each leaves).",
    ),
) -> None:
    """Check that a recipe's training step fits its devices, and predict its step time, before launching it.

    On this CPU: one step of each pipeline rank, built and parallelised as for training, is traced under fake
    tensors on a fake process group of the run's world size. Prints a table per pipeline rank; exit status 1 when
    a rank's peak (with --cp: every degree) does not fit.
    """
    overrides = [*ctx.args, *(["--plan.device", device] if device else [])]
    if world_size is None:
        p = read_config(config, overrides).parallel
        world_size = degrees_world_size(p)
        if p.dp_shard == -1:  # it takes what the world size leaves: plan the smallest world
            typer.echo(f"planned on {world_size} device{'s' * (world_size > 1)} (parallel.dp_shard = -1 and no "
                       "--world-size; give --world-size to plan a bigger world)")  # fmt: skip
    degrees = _cp_degrees(cp) if cp is not None else []
    if degrees and graph:
        raise UserError("give --cp or --graph, not both: --cp plans whole steps, --graph one block")
    cfg = load_config(config, overrides, world_size=world_size)
    if graph and cfg.parallel.cp > 1:
        share = cfg.training.seq_len // cfg.parallel.cp
        raise UserError(
            f"--graph traces one block on whole rows with plain attention, not a parallel.cp rank's share; to see a "
            f"block at that share, give --parallel.cp 1 --training.seq_len {share}"
        )
    from titan.tools.plan.estimate import plan_run  # imported late: torch takes a while to import
    from titan.tools.plan.graph import analyse_recipe
    from titan.tools.plan.report import format_cp_comparison, format_graph, format_plan, plan_json, shortfall

    if degrees:
        plans = {}
        for degree in degrees:
            try:
                layout = ["--parallel.cp", str(degree), "--parallel.dp_shard", "-1"]
                plans[degree] = plan_run(load_config(config, [*overrides, *layout], world_size=world_size), world_size)
            except ConfigError as e:  # a degree the recipe cannot be cut into: its line says why
                plans[degree] = str(e)
        typer.echo(format_cp_comparison(plans, world_size))
        if json_path is not None:
            by_degree = {d: {"error": p} if isinstance(p, str) else plan_json(p) for d, p in plans.items()}
            json_path.write_text(json.dumps({"cp": by_degree}, indent=2) + "\n")
        if not any(not isinstance(p, str) and shortfall(p) is None for p in plans.values()):
            raise typer.Exit(code=1)
        return
    if graph:
        analysis, what = analyse_recipe(cfg, world_size)
        typer.echo(format_graph(analysis, what))
        if json_path is not None:
            json_path.write_text(json.dumps(analysis.as_json(), indent=2) + "\n")
        return
    result = plan_run(cfg, world_size)
    typer.echo(format_plan(result))
    if json_path is not None:
        json_path.write_text(json.dumps(plan_json(result), indent=2) + "\n")
    short = shortfall(result)
    if short:
        typer.secho(f"error: {short}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=1)


def _cp_degrees(text: str) -> list[int]:
    """`titan plan --cp 1,2,4,8`: the degrees to compare."""
    try:
        degrees = [int(item) for item in text.split(",")]
    except ValueError:
        degrees = []
    if not degrees or min(degrees) < 1:
        raise UserError(f"--cp {text}: give context-parallel degrees separated by commas, e.g. --cp 1,2,4,8")
    return sorted(set(degrees))


@simulate_app.command("stragglers")
def simulate_stragglers(
    devices: int = typer.Option(1024, help="Devices in the cluster."),
    tp: int = typer.Option(8, help="Tensor-parallel degree."),
    pp: int = typer.Option(1, help="Pipeline-parallel degree."),
    steps: int = typer.Option(300, help="Training steps to simulate."),
    local_batch_size: int = typer.Option(8, help="Most rows per micro-batch (4,096 rows per step)."),
    slow_factor: float = typer.Option(3.0, help="One device this many times slower ..."),
    slow_start: int = typer.Option(50, help="... from this step ..."),
    slow_end: int = typer.Option(150, help="... to this one."),
    blip_rate: float = typer.Option(1e-5, help="Chance per device and step of a brief slowdown."),
    seed: int = typer.Option(0),
) -> None:
    """Static even shares, titan's straggler re-planning, and an oracle, on one speed trace."""
    from titan.tools.simulate.stragglers import Scenario, compare

    if devices % (tp * pp):
        raise UserError(f"--devices {devices} is not a multiple of --tp x --pp = {tp * pp}")
    s = Scenario(devices, tp, pp, steps, local_batch_size=local_batch_size, slow_factor=slow_factor,
                 slow_start=slow_start, slow_end=slow_end, blip_rate=blip_rate, seed=seed)  # fmt: skip
    try:
        results = compare(s)
    except ValueError as e:
        raise UserError(f"no runnable plan: {e}") from None
    typer.echo(
        f"{s.devices} devices, {s.replicas} data-parallel replicas of tp {tp} x pp {pp}, {steps} steps, "
        f"micro-batches of at most {local_batch_size} rows"
    )
    typer.echo(f"{'policy':<8}{'rows/s':>10}{'slow phase rows/s':>19}{'re-plans':>10}")
    for policy, r in results.items():
        typer.echo(f"{policy:<8}{r['rows_per_s']:>10,.0f}{r['slow_phase_rows_per_s']:>19,.0f}{r['replans']:>10}")


@simulate_app.command("packing")
def simulate_packing(
    replicas: int = typer.Option(64, help="Data-parallel replicas."),
    steps: int = typer.Option(10, help="Steps (global batches) to simulate."),
    flavor: list[str] = typer.Option(["8B", "1B"], help="Llama 3 flavors whose FLOPs make the cost model."),
    seed: int = typer.Option(0),
    cp: int = typer.Option(
        1, help="Context-parallel degree: > 1 compares placements of documents up to 128k tokens on cp groups."
    ),
) -> None:
    """Token-balanced against cost-balanced packing of long-tailed documents, without and with a 4-stage
    pipeline: mean predicted step time, a lower bound no placement beats, imbalance (slowest replica over
    mean) and planning time. With --cp: static context parallelism against CP placement."""
    from titan.tools.simulate.packing import PackingScenario, simulate

    if cp > 1:
        _simulate_packing_cp(replicas, steps, flavor, seed, cp)
        return
    typer.echo(
        f"{replicas} replicas, {steps} steps; documents lognormal (median 1024, sigma 1.0) clipped at 32k; "
        "32k tokens per micro-batch"
    )
    typer.echo(f"{'flavor':<8}{'pp':>3}{'tokens s/step':>15}{'cost s/step':>13}{'bound s/step':>14}"
               f"{'speed-up':>10}{'imbalance tokens/cost':>23}{'plan ms':>9}")  # fmt: skip
    for name in flavor:
        for pp, micro_batches in ((1, 2), (4, 8)):
            r = simulate(PackingScenario(replicas, pp, name, micro_batches=micro_batches, steps=steps, seed=seed))
            typer.echo(
                f"{name:<8}{pp:>3}{r['tokens_step_s']:>15.3f}{r['cost_step_s']:>13.3f}{r['bound_step_s']:>14.3f}"
                f"{r['speedup']:>9.3f}x"
                f"{r['tokens_imbalance']:>14.3f} / {r['cost_imbalance']:.3f}{r['plan_ms']:>9.0f}"
            )


def _simulate_packing_cp(replicas: int, steps: int, flavors: list[str], seed: int, cp: int) -> None:
    from titan.tools.simulate.packing import CP_POLICIES, PackingScenario, simulate_cp

    if replicas % cp:
        raise UserError(f"--replicas {replicas} do not form cp groups of --cp {cp}")
    scenario = PackingScenario(
        replicas, cp=cp, capacity=131072 // cp, max_len=131072, sigma=1.5, steps=steps, seed=seed
    )
    typer.echo(
        f"{replicas} ranks ({replicas // cp} cp groups of {cp}), {steps} steps; documents lognormal (median "
        f"{scenario.median_len}, sigma {scenario.sigma}) clipped at 128k; rows of 128k tokens, {scenario.capacity} "
        f"per rank; ring links {scenario.link_bytes_per_s / 1e9:.0f} GB/s"
    )
    for key, policy in CP_POLICIES.items():
        typer.echo(f"  {key}: {policy}")
    typer.echo(
        f"{'flavor':<8}{'policy':<8}{'s/step':>9}{'over bound':>12}{'imbalance':>11}{'plan ms':>9}{'speed-up':>10}"
    )
    for name in flavors:
        results = simulate_cp(dataclasses.replace(scenario, flavor=name))
        for key in CP_POLICIES:
            r = results[key]
            speedup = results["tokens"]["step_s"] / r["step_s"]
            typer.echo(
                f"{name:<8}{key:<8}{r['step_s']:>9.3f}{r['over_bound']:>11.3f}x{r['imbalance']:>11.3f}"
                f"{r['plan_ms']:>9.0f}{speedup:>9.2f}x"
            )
        typer.echo(f"{name:<8}{'bound':<8}{results['bound']['step_s']:>9.3f}")


def check_torch(version: str | None) -> str | None:
    """Refuse a torch that titan was not written for (`pip install --no-deps` into an image skips pip's check of
    the pin); returns a warning for a torch newer than the tested ones. `version`: torch's, None if not installed."""
    low, high = TORCH_VERSIONS
    wanted = f"torch >= {low[0]}.{low[1]} and < {high[0]}.{high[1]}"
    if version is None:
        raise UserError(f"titan needs {wanted}, and this Python has no torch: install one (e.g. pip install torch)")
    major_minor = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", version).groups())
    if major_minor < low:
        raise UserError(
            f"titan needs {wanted}; this Python has torch {version}: use an image or environment with a newer torch"
        )
    if major_minor >= high:
        return f"titan is tested on {wanted}; this is torch {version}, which may work"
    return None


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    """The `titan` command. A UserError ends it with its message as one line on stderr and exit status 2; under
    torchrun only rank 0 prints (every rank fails alike)."""
    try:
        if warning := check_torch(_torch_version()):
            if os.environ.get("RANK", "0") == "0":
                typer.secho(f"warning: {warning}", err=True, fg=typer.colors.YELLOW)
        app(prog_name="titan")
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        _leave_together()
        sys.exit(2)
    finally:
        dist = sys.modules.get("torch.distributed")  # not imported when the recipe was refused: a quick exit
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
