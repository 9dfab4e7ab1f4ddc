"""Every bad input a user can give, through the real CLI: exit status 2, one `error:` line naming the culprit,
no traceback. One table across the recipe, the data, the checkpoint, the parallel layout and faults.

Recipe cases run `titan config show` (no torch, fast); the others `titan train` of a tiny run, and fail
before training (the layout ones with WORLD_SIZE set as torchrun sets it: the layout is checked before the
process group is joined)."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import math
import os
import pickle
import shutil
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch
import zstandard

from conftest import DEBUG_RECIPE, ROOT, run_titan, run_titan_many, tiny_overrides, torchrun
from helpers import SAVED, SMALL, assert_one_line_error, imported_modules
from runs import trained_run
from titan.checkpoint.format import INDEX, MANIFEST, MARKER, PROVEN, CheckpointReader, sha256_files


def recipe_file(text: str | bytes):
    """Setup: a recipe file with this content, used as --config."""

    def write(tmp: Path, _saved: Path) -> dict:
        path = tmp / "recipe.toml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return {"--config": str(path)}

    return write


def stages_recipe(*stages: str):
    """Setup: a recipe of these [[data.stages]] tables (the keys each adds to its table), each reading one source
    unless its keys end in a comment."""
    tables = "".join(
        f"[[data.stages]]\n{keys}\n" + ("" if keys.endswith("#") else "[[data.stages.sources]]\nsource = 'a.jsonl'\n")
        for keys in stages
    )
    return recipe_file(f"[tokenizer]\npath = 'data/tokenizer.json'\n[lr_scheduler]\ndecay = 'wsd'\n{tables}")


def data_file(name: str, content):
    """Setup: a data file of `content` (bytes, or a function that makes them: large ones are made when run)."""

    def write(tmp: Path, _saved: Path) -> dict:
        path = tmp / name
        path.write_bytes(content() if callable(content) else content)
        return {"data.source": str(path)}

    return write


def saved_dataset_naming(filename: str):
    """Setup: a folder laid out as HF datasets' save_to_disk writes it, its state.json naming `filename`."""

    def write(tmp: Path, _saved: Path) -> dict:
        folder = tmp / "saved"
        folder.mkdir()
        (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": filename}]}))
        (folder / "dataset_info.json").write_text("{}")
        return {"data.source": str(folder)}

    return write


def damaged_checkpoint(damage):
    """Setup: a copy of the saved step-2 checkpoint, damaged, resumed explicitly."""

    def write(tmp: Path, saved: Path) -> dict:
        copy = tmp / "step-2"
        shutil.copytree(saved, copy)
        damage(copy)
        return {**SAVED, "checkpoint.resume": str(copy)}

    return write


def flip_byte(folder: Path):
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x10
    (folder / "__0_0.distcp").write_bytes(bytes(data))


def truncate(folder: Path):
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])


def reseal(folder: Path) -> None:
    """A manifest of the folder's files as they are now: whoever crafts a checkpoint writes one whose sums pass."""
    names = sorted(p.name for p in folder.iterdir() if p.name not in (MANIFEST, MARKER))
    (folder / MANIFEST).write_text(json.dumps({"files": sha256_files(folder, names)}))


def edit_json(name: str, edit):
    """Damage (folder, *_): the checkpoint's JSON file `name` replaced by `edit(its content)`, the manifest
    rewritten to match; `edit` returning a str writes that text as it is."""

    def damage(folder: Path, *_) -> None:
        value = edit(json.loads((folder / name).read_text()))
        (folder / name).write_text(value if isinstance(value, str) else json.dumps(value))
        reseal(folder)

    return damage


def with_values(name: str, **values):
    """Damage: the checkpoint's JSON file `name` with these top-level values."""
    return edit_json(name, lambda content: {**content, **values})


def as_written_by_an_older_titan(folder: Path) -> None:
    (folder / INDEX).rename(folder / ".metadata")  # where its pickled index was (refused before it is read)
    reseal(folder)


def resume_saved(**extra):
    def use(tmp: Path, saved: Path) -> dict:
        return {**SAVED, "checkpoint.resume": str(saved), **extra}

    return use


def hf_model_with_a_larger_tokenizer(tmp: Path, saved: Path) -> dict:
    """Setup: the saved checkpoint as an HF folder whose tokenizer has one token more than its embedding rows, which
    a recipe naming no tokenizer takes."""
    from tokenizers import Tokenizer

    from titan.checkpoint.hf import dcp_to_hf

    folder = tmp / "hf"
    dcp_to_hf(saved, folder)
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(rows + 1 - tokenizer.get_vocab_size())])
    tokenizer.save(str(folder / "tokenizer.json"))
    return {"checkpoint.init_from_hf": str(folder), "tokenizer.path": ""}


def output_folder(tmp: Path, _saved: Path) -> dict:
    """Setup: a fresh output folder, for a `cli` case that trains."""
    return {"--job.output_dir": str(tmp)}


def output_is_a_file(tmp: Path, _saved: Path) -> dict:
    (tmp / "afile").write_text("")
    return {"job.output_dir": str(tmp / "afile")}


def saved_checkpoint(_tmp: Path, saved: Path) -> dict:
    return {"--checkpoint": str(saved)}


def task_running_code(tmp: Path, saved: Path) -> dict:
    """Setup: a task folder whose YAML names a Python function (lm-eval would import and run it)."""
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / "sneaky.yaml").write_text("task: sneaky\ndataset_path: json\nprocess_docs: !function os.system\n")
    return {"--include-path": str(tmp / "tasks"), **saved_checkpoint(tmp, saved)}


def tokenizer_out(tmp: Path, _saved: Path) -> dict:
    return {"--out": str(tmp / "tokenizer.json")}


def empty_documents(tmp: Path, saved: Path) -> dict:
    (tmp / "empty.jsonl").write_text('{"text": ""}\n' * 3)
    return {"--data": str(tmp / "empty.jsonl"), **tokenizer_out(tmp, saved)}


def metrics_on_a_full_disk(tmp: Path, _saved: Path) -> dict:
    (tmp / "debug").mkdir()
    (tmp / "debug" / "metrics.jsonl").symlink_to("/dev/full")
    return SAVED


# (id, command, overrides: dict for `train` (on top of a tiny run), list for `show` or the arguments of `cli` (any
# command, with the options `setup` returns), setup, env, words)
CASES = [
    # -- the recipe: keys, types, ranges
    ("key typo", "show", ["--training.step", "3"], None, {}, ["training.step", "did you mean training.steps"]),
    ("section typo", "show", ["--trainig.steps", "3"], None, {}, ["trainig", "did you mean training"]),
    ("key without section", "show", ["--steps", "3"], None, {}, ["'steps'", "did you mean training.steps"]),
    ("key in the wrong section", "show", ["--optimizer.seq_len", "3"], None, {}, ["did you mean training.seq_len"]),
    ("a section given a value", "show", ["--training", "3"], None, {}, ["[training] must be a table"]),
    ("int given a word", "show", ["--training.steps", "many"], None, {}, ["training.steps", "int", "many"]),
    ("int given a bool", "show", ["--training.steps", "true"], None, {}, ["training.steps must be int", "True"]),
    ("int given a list", "show", ["--training.steps", "[1, 2]"], None, {}, ["training.steps must be int"]),
    ("float given a word", "show", ["--optimizer.lr", "fast"], None, {}, ["optimizer.lr", "float", "fast"]),
    ("negative steps", "show", ["--training.steps", "-5"], None, {}, ["training.steps", "positive", "-5"]),
    ("zero seq_len", "show", ["--training.seq_len", "0"], None, {}, ["training.seq_len", "positive"]),
    ("zero local batch", "show", ["--training.local_batch_size", "0"], None, {}, ["training.local_batch_size"]),
    ("negative clip", "show", ["--training.max_grad_norm", "-1"], None, {}, ["training.max_grad_norm", ">= 0"]),
    ("unknown choice", "show", ["--lr_scheduler.decay", "exponential"], None, {}, ["lr_scheduler.decay", "cosine"]),
    ("fp16", "show", ["--training.mixed_precision", "fp16"], None, {}, ["training.mixed_precision", "'bf16'"]),
    ("device", "show", ["--training.device", "tpu"], None, {}, ["training.device", "'cuda'", "tpu"]),
    ("on_nonfinite", "show", ["--training.on_nonfinite", "ignore"], None, {}, ["training.on_nonfinite", "'skip'"]),
    ("max_skipped_steps", "show", ["--training.max_skipped_steps", "0"], None, {}, ["training.max_skipped_steps"]),
    ("beta2", "show", ["--optimizer.beta2", "1.5"], None, {}, ["beta2", "1.5"]),
    ("eps", "show", ["--optimizer.eps", "0"], None, {}, ["optimizer.eps must be > 0"]),
    ("qk_clip_tau negative", "show", ["--optimizer.qk_clip_tau", "-1"], None, {}, ["optimizer.qk_clip_tau", ">= 0"]),
    ("min_lr_ratio", "show", ["--lr_scheduler.min_lr_ratio", "2"], None, {}, ["lr_scheduler.min_lr_ratio", "[0, 1]"]),
    (
        "a torchtitan key in a recipe",  # on the command line, --job.config_file is --config
        "show",
        [],
        recipe_file('[job]\nconfig_file = "x.toml"\n'),
        {},
        ["job.config_file", "the recipe is --config"],
    ),
    ("log_freq", "show", ["--metrics.log_freq", "0"], None, {}, ["metrics.log_freq"]),
    ("peak_flops", "show", ["--metrics.peak_flops", "-1"], None, {}, ["metrics.peak_flops"]),
    ("job name", "show", ["--job.name", "a/b"], None, {}, ["job.name", "'a/b'"]),
    ("tokenizer path", "show", ["--tokenizer.path", ""], None, {}, ["tokenizer.path"]),
    ("validation fraction", "show", ["--validation.fraction", "1.0"], None, {}, ["validation.fraction", "[0, 1)"]),
    ("validation steps", "show", ["--validation.steps", "0"], None, {}, ["validation.steps must be positive"]),
    ("prepare workers", "show", ["--data.prepare_workers", "-1"], None, {}, ["data.prepare_workers"]),
    ("checkpoint interval", "show", ["--checkpoint.interval", "0"], None, {}, ["checkpoint.interval"]),
    ("keep_latest_k", "show", ["--checkpoint.keep_latest_k", "-1"], None, {}, ["checkpoint.keep_latest_k"]),
    ("load_only", "show", ["--checkpoint.load_only", "weights"], None, {}, ["checkpoint.load_only", "weights"]),
    (
        "allow_changes of an unchecked key",
        "show",
        ["--checkpoint.allow_changes", "metrics.log_freq"],
        None,
        {},
        ["checkpoint.allow_changes", "metrics.log_freq", "optimizer.lr"],
    ),
    ("straggler threshold", "show", ["--straggler.threshold", "0.9"], None, {}, ["straggler.threshold must be >= 1"]),
    ("straggler window", "show", ["--straggler.window", "0"], None, {}, ["straggler.interval and straggler.window"]),
    (
        "float8 all-gather rowwise",
        "show",
        ["--float8.enable_fsdp_float8_all_gather", "true", "--float8.recipe", "rowwise"],
        None,
        {},
        ["float8.enable_fsdp_float8_all_gather", "tensorwise", "rowwise"],
    ),
    (
        "float8 precompute alone",
        "show",
        ["--float8.precompute_dynamic_scale", "true"],
        None,
        {},
        ["float8.precompute_dynamic_scale", "enable_fsdp_float8_all_gather"],
    ),
    ("recipe missing", "show", ["--config", "recipes/nope.toml"], None, {}, ["recipe file not found", "nope.toml"]),
    ("recipe not TOML", "show", [], recipe_file("[training\nsteps = 3\n"), {}, ["recipe.toml", "not valid TOML"]),
    ("recipe not UTF-8", "show", [], recipe_file(b"\xff\xfe[training]\n"), {}, ["recipe.toml", "not UTF-8"]),
    (
        "recipe wrong type",
        "show",
        [],
        recipe_file('[training]\nsteps = "ten"\n'),
        {},
        ["training.steps must be int", "'ten'"],
    ),
    ("recipe unknown section", "show", [], recipe_file("[trainer]\nsteps = 3\n"), {}, ["unknown section 'trainer'"]),
    (
        "mixture weight",
        "show",
        [],
        recipe_file('[[data.sources]]\nsource = "a.jsonl"\nweight = 0\n'),
        {},
        ["data.sources[0].weight must be > 0"],
    ),
    (
        "mixture weight infinite",
        "show",
        [],
        recipe_file('[[data.sources]]\nsource = "a.jsonl"\nweight = inf\n'),
        {},
        ["data.sources[0].weight must be > 0 and finite", "inf"],
    ),
    (
        "mixture weight too small for the blend",
        "show",
        [],
        recipe_file('[[data.sources]]\nsource = "a.jsonl"\n[[data.sources]]\nsource = "b.jsonl"\nweight = 1e-7\n'),
        {},
        ["data.sources[1].weight = 1e-07", "under one sample in 1048576", "at least 9.63e-07"],
    ),
    # -- data stages
    (
        "a stage starting before the one before it",
        "show",
        [],
        stages_recipe("", "start_step = 5", "start_tokens = 100"),
        {},
        ["data.stages[2] starts at step 1 (start_tokens 100 at 2048 tokens a step)", "not after data.stages[1]"],
    ),
    (
        "a stage's weights summing to no positive number",
        "show",
        [],
        stages_recipe("", "start_step = 5\n[[data.stages.sources]]\nsource = 'a.jsonl'\nweight = 0\n#"),
        {},
        ["data.stages[1].sources[0].weight must be > 0"],
    ),
    ("a stage of no source", "show", [], stages_recipe("", "start_step = 5\n#"), {}, ["data.stages[1] has no sources"]),
    (
        "a decay stage without wsd",
        "show",
        ["--lr_scheduler.decay", "cosine"],
        stages_recipe("", "start_step = 5\ndecay = true"),
        {},
        ["data.stages[1].decay = true", "lr_scheduler.decay is 'cosine'", "set lr_scheduler.decay = 'wsd'"],
    ),
    (
        "stages with tokens batching",
        "show",
        ["--data.batching", "tokens"],
        stages_recipe(""),
        {},
        ["data.stages with data.batching = 'tokens' is not supported", "use data.batching = 'rows'"],
    ),
    ("stages beside data.source", "show", ["--data.source", "a.jsonl"], stages_recipe(""), {}, ["leave data.source"]),
    # -- the global batch and the layout's degrees
    (
        "global batch below data-parallel size",
        "show",
        ["--training.global_batch_size", "3"],
        None,
        {"WORLD_SIZE": "4"},
        ["global_batch_size (3)", "4 data-parallel", "at least 1"],
    ),
    (
        "global batch in no equal count of micro-batches",
        "show",
        ["--training.global_batch_size", "10", "--training.local_batch_size", "1"],
        None,
        {"WORLD_SIZE": "4"},
        ["global_batch_size (10)", "4 data-parallel", "same number of micro-batches", "at most 1 row"],
    ),
    (
        "dp_weights count",
        "show",
        ["--parallel.dp_weights", "[1, 2, 3]"],
        None,
        {"WORLD_SIZE": "2"},
        ["parallel.dp_weights has 3 entries", "2 data-parallel"],
    ),  # fmt: skip
    (
        "dp_weights zero",
        "show",
        ["--parallel.dp_weights", "[1, 0]"],
        None,
        {"WORLD_SIZE": "2"},
        ["parallel.dp_weights must all be > 0"],
    ),  # fmt: skip
    (
        "dp_weights infinite",
        "show",
        ["--parallel.dp_weights", "[1, inf]"],
        None,
        {"WORLD_SIZE": "2"},
        ["parallel.dp_weights must all be > 0 and finite", "inf"],
    ),  # fmt: skip
    (
        "straggler with dp and pp",
        "show",
        ["--straggler.enable", "true", "--parallel.pp", "2", "--parallel.dp_shard", "2"],
        None,
        {"WORLD_SIZE": "4"},
        ["straggler.enable", "not supported yet"],
    ),  # fmt: skip
    ("degrees vs world", "show", ["--parallel.tp", "2"], None, {"WORLD_SIZE": "3"}, ["tp=2", "world size 3"]),
    (
        "degrees product",
        "train",
        {"parallel.tp": "2", "parallel.dp_shard": "3"},
        None,
        {"WORLD_SIZE": "4"},
        ["dp_shard=3", "tp=2", "world size 4"],
    ),  # fmt: skip
    ("zero pp", "show", ["--parallel.pp", "0"], None, {}, ["parallel.pp must be >= 1"]),
    ("zero cp", "show", ["--parallel.cp", "0"], None, {}, ["parallel.cp must be >= 1"]),
    ("cp vs world", "show", ["--parallel.cp", "2"], None, {"WORLD_SIZE": "3"}, ["cp=2", "world size 3"]),
    (
        "cp chunks of the sequence",
        "show",
        ["--parallel.cp", "2", "--training.seq_len", "66"],
        None,
        {"WORLD_SIZE": "2"},
        ["training.seq_len 66", "2 x parallel.cp = 4", "multiple of 4"],
    ),
    *(
        (
            f"cp with {what}",
            "show",
            ["--parallel.cp", "2", *flags],
            None,
            {"WORLD_SIZE": world},
            [f"parallel.cp > 1 with {what}", "not supported yet", why],
        )
        for what, flags, world, why in (
            (
                "data.batching = 'tokens' and parallel.pp > 1",
                ["--data.batching", "tokens", "--training.local_batch_size", "1", "--parallel.pp", "2"],
                "4",
                "pipeline's fixed micro-batch shapes",
            ),
        )
    ),
    (
        "cp with a document longer than a ring row",
        "show",
        [
            "--parallel.cp",
            "2",
            "--data.batching",
            "tokens",
            "--training.local_batch_size",
            "1",
            "--data.max_document_len",
            "512",
        ],
        None,
        {"WORLD_SIZE": "2"},
        ["data.max_document_len 512", "training.seq_len 256", "one ring row"],
    ),  # fmt: skip
    (
        "cp with documents in micro-batches of several rows",
        "show",
        ["--parallel.cp", "2", "--data.batching", "tokens"],
        None,
        {"WORLD_SIZE": "2"},
        ["training.local_batch_size 8", "parallel.cp > 1", "set local_batch_size = 1"],
    ),  # fmt: skip
    ("zero dp_shard", "show", ["--parallel.dp_shard", "0"], None, {}, ["parallel.dp_shard must be >= 1 or -1"]),
    (
        "tp vs heads",
        "train",
        {"parallel.tp": "3", "model.overrides.n_heads": "4"},
        None,
        {"WORLD_SIZE": "3"},
        ["parallel.tp = 3", "n_heads (4)"],
    ),  # fmt: skip
    (
        "tp vs kv heads",
        "train",
        {"parallel.tp": "2", "model.overrides.n_kv_heads": "1"},
        None,
        {"WORLD_SIZE": "2"},
        ["parallel.tp = 2", "n_kv_heads (1)"],
    ),  # fmt: skip
    (
        "pp vs layers",
        "train",
        {"parallel.pp": "8", "training.local_batch_size": "8"},  # a batch its 8 micro-batches can cut
        None,
        {"WORLD_SIZE": "8"},
        ["8 pipeline stages", "2 layers"],
    ),  # fmt: skip
    (
        "pp too few micro-batches",
        "train",
        {"parallel.pp": "2", "parallel.pp_microbatches": "1"},
        None,
        {"WORLD_SIZE": "2"},
        ["pp_microbatches (1)", "at least parallel.pp (2)"],
    ),  # fmt: skip
    (
        "pp micro-batch split",
        "train",
        {"parallel.pp": "2", "parallel.pp_microbatches": "3"},
        None,
        {"WORLD_SIZE": "2"},
        ["local_batch_size (4)", "pp_microbatches (3)"],
    ),  # fmt: skip
    (
        "pp schedule name",
        "train",
        {"parallel.pp": "2", "parallel.pp_schedule": "Zigzag"},
        None,
        {"WORLD_SIZE": "2"},
        ["parallel.pp_schedule", "Zigzag", "1F1B"],
    ),  # fmt: skip
    (
        "pp schedule name without pp",
        "train",
        {"parallel.pp_schedule": "Zigzag"},
        None,
        {},
        ["parallel.pp_schedule", "Zigzag"],
    ),  # fmt: skip
    (
        "pp layer list",
        "train",
        {"parallel.pp": "2", "parallel.pp_layers_per_stage": "[1, 2]"},
        None,
        {"WORLD_SIZE": "2"},
        ["pp_layers_per_stage [1, 2]", "2 layers"],
    ),  # fmt: skip
    (
        "zero-bubble reshard",
        "train",
        {
            "parallel.pp": "2",
            "parallel.dp_shard": "2",
            "parallel.pp_schedule": "ZBVZeroBubble",
            "parallel.fsdp_reshard_after_forward": "always",
            "model.overrides.n_layers": "4",
        },
        None,
        {"WORLD_SIZE": "4"},
        ["fsdp_reshard_after_forward", "ZBVZeroBubble"],
    ),  # fmt: skip
    # -- whole documents per step (data.batching = "tokens")
    (
        "tokens batching without document masks",
        "show",
        ["--data.batching", "tokens", "--data.document_mask", "false"],
        None,
        {},
        ["data.batching = 'tokens'", "data.document_mask = true"],
    ),
    (
        "tokens batching compiled",
        "show",
        ["--data.batching", "tokens", "--compile.enable", "true"],
        None,
        {},
        ["compile.enable", "data.batching = 'tokens'"],
    ),
    (
        "cost model of two numbers",
        "show",
        ["--data.batching", "tokens", "--data.cost_model", "[1e-6, 1e-4]"],
        None,
        {},
        ["data.cost_model", "[a, b, c]"],
    ),
    (
        "cost model infinite",
        "show",
        ["--data.batching", "tokens", "--data.cost_model", "[1e-6, inf, 1e-3]"],
        None,
        {},
        ["data.cost_model", "finite", "inf"],
    ),
    (
        "cost model pricing documents at zero",
        "show",
        ["--data.batching", "tokens", "--data.cost_model", "[0, 0, 1e-3]"],
        None,
        {},
        ["data.cost_model", "sends them all to rank 0", "set a or b > 0"],
    ),
    (
        "tokens batching with dropout",
        "train",
        {"data.batching": "tokens", "model.overrides.resid_dropout": "0.1"},
        None,
        {},
        ["does not support dropout", "resid_dropout"],
    ),
    (
        "document piece larger than a micro-batch",
        "train",
        {"data.batching": "tokens", "data.max_document_len": "512", "model.overrides.resid_dropout": "0"},
        None,
        {},
        ["data.max_document_len 512", "fits no micro-batch", "128 tokens"],
    ),
    (
        "compile tp sp on CPU",
        "train",
        {"parallel.tp": "2", "compile.enable": "true"},
        None,
        {"WORLD_SIZE": "2"},
        ["compile.enable", "sequence_parallel"],
    ),  # fmt: skip
    (
        "V schedule with validation",
        "train",
        {
            "parallel.pp": "2",
            "parallel.pp_schedule": "DualPipeV",
            "validation.interval": "10",
            "model.overrides.n_layers": "4",
        },
        None,
        {"WORLD_SIZE": "2"},
        ["validation", "DualPipeV", "validation.interval = 0"],
    ),  # fmt: skip
    (
        "pp stage speeds",
        "train",
        {"parallel.pp": "2", "parallel.pp_stage_speeds": "[1, 2, 3]"},
        None,
        {"WORLD_SIZE": "2"},
        ["pp_stage_speeds", "2 positive"],
    ),  # fmt: skip
    (
        "pp stage memory",
        "train",
        {"parallel.pp": "2", "parallel.pp_stage_speeds": "[1, 1]", "parallel.pp_stage_memory_gib": "[0.0000001, 1]"},
        None,
        {"WORLD_SIZE": "2"},
        ["pp_stage_memory_gib", "no split of the 2 layers", "raise the caps"],
    ),  # fmt: skip
    (
        "pp stage memory without speeds",
        "train",
        {"parallel.pp": "2", "parallel.pp_stage_memory_gib": "[0.0000001, 1]"},
        None,
        {"WORLD_SIZE": "2"},
        ["pp_stage_memory_gib", "no split of the 2 layers", "raise the caps"],
    ),  # fmt: skip
    (
        "pp stage memory with a fixed split",
        "show",
        ["--parallel.pp_stage_memory_gib", "[4, 4]", "--parallel.pp_layers_per_stage", "[1, 1]"],
        None,
        {},
        ["parallel.pp_stage_memory_gib", "parallel.pp_layers_per_stage sets it", "leave one"],
    ),  # fmt: skip
    (
        "pp stage memory zero",
        "show",
        ["--parallel.pp_stage_memory_gib", "[0, 4]"],
        None,
        {},
        ["parallel.pp_stage_memory_gib must all be GiB > 0"],
    ),  # fmt: skip
    (
        "pp stage speed infinite",
        "show",
        ["--parallel.pp_stage_speeds", "[1, inf]"],
        None,
        {},
        ["parallel.pp_stage_speeds must all be > 0 and finite", "inf"],
    ),  # fmt: skip
    (
        "cuda without a GPU",
        "train",
        {"training.device": "cuda"},
        None,
        {},
        ["training.device = 'cuda'", "without CUDA"],
    ),  # fmt: skip
    # -- the model
    ("flavor", "train", {"model.flavor": "7B"}, None, {}, ["model.flavor", "7B", "debug"]),
    ("model name", "train", {"model.name": "gpt5"}, None, {}, ["model.name", "gpt5", "llama3"]),
    ("qk_clip on qk_norm", "cli", ["train", "--config", "recipes/debug_moe.toml", "--model.overrides.qk_norm", "true",
     "--optimizer.qk_clip_tau", "100", "--data.source", "data/stories.jsonl", "--tokenizer.path",
     "data/tokenizer.json", "--training.seq_len", "32"], output_folder, {},
     ["optimizer.qk_clip_tau = 100.0", "qk_norm", "set optimizer.qk_clip_tau = 0"]),
    ("override typo", "train", {"model.overrides.n_layer": "2"}, None, {}, ["model.overrides.n_layer", "n_layers"]),
    ("override type", "train", {"model.overrides.dim": "1.5"}, None, {}, ["model.overrides.dim must be int"]),
    # config show checks what train checks before reading data
    ("flavor in config show", "show", ["--model.flavor", "7B"], None, {}, ["model.flavor", "7B", "debug"]),
    (
        "override typo in config show",
        "show",
        ["--model.overrides.n_layerz", "3"],
        None,
        {},
        ["model.overrides.n_layerz", "did you mean n_layers"],
    ),  # fmt: skip
    (
        "tp vs kv heads in config show",
        "show",
        ["--parallel.tp", "2", "--model.overrides.n_kv_heads", "1"],
        None,
        {"WORLD_SIZE": "2"},
        ["parallel.tp = 2", "n_kv_heads (1)"],
    ),  # fmt: skip
    (
        "heads not dividing dim",
        "train",
        {"model.overrides.n_heads": "5"},
        None,
        {},
        ["model.overrides", "dim (64) must divide by n_heads (5)"],
    ),  # fmt: skip
    (
        "dropout 1",
        "train",
        {"model.overrides.resid_dropout": "1.0"},
        None,
        {},
        ["model.overrides", "resid_dropout must be in [0, 1)"],
    ),  # fmt: skip
    ("zero layers", "train", {"model.overrides.n_layers": "0"}, None, {}, ["model.overrides", "n_layers must be >= 1"]),
    (
        "seq_len above the model's",
        "train",
        {"training.seq_len": "4096"},
        None,
        {},
        ["training.seq_len 4096", "max_seq_len 2048", "model.overrides.max_seq_len"],
    ),  # fmt: skip
    (
        "tokenizer larger than the model's vocabulary",
        "train",
        {"model.overrides.vocab_size": "100"},
        None,
        {},
        ["tokenizer has", "vocab_size is 100"],
    ),  # fmt: skip
    # -- data and tokenizer
    (
        "tokenizer missing",
        "train",
        {"tokenizer.path": "missing/tokenizer.json"},
        None,
        {},
        ["tokenizer.path", "missing/tokenizer.json"],
    ),  # fmt: skip
    (
        "data missing",
        "train",
        {"data.source": "missing/corpus.jsonl"},
        None,
        {},
        ["data.source", "missing/corpus.jsonl"],
    ),  # fmt: skip
    ("text field", "train", {"data.text_field": "body"}, None, {}, ["data.text_field", "'body'", "text"]),
    (
        "a line of 33M characters",
        "train",
        {"data.text_unit": "line"},
        data_file("long.txt.gz", lambda: gzip.compress(b"short line\n" + b"a" * (33 * 2**20) + b"\n")),
        {},
        ["line 2 of", "long.txt.gz runs over 33,554,432 characters", "split it"],
    ),  # fmt: skip
    (
        "a JSON lines record of 33M characters",
        "train",
        {},
        data_file("long.jsonl.gz", lambda: gzip.compress(b'{"text": "' + b"a" * (33 * 2**20) + b'"}\n')),
        {},
        ["line 1 of", "long.jsonl.gz runs over 33,554,432 characters"],
    ),  # fmt: skip
    (
        "a JSON array of 33M characters",
        "train",
        {},
        data_file("big.json.gz", lambda: gzip.compress(b'[{"text": "' + b"a" * (33 * 2**20) + b'"}]')),
        {},
        ["big.json.gz is one JSON array of over 33,554,432 characters", "write one record per line"],
    ),  # fmt: skip
    ("a mistyped data folder", "train", {"data.source": "missing-books/"}, None, {},
     ["data.source: file or folder not found: missing-books"]),
    (
        "a .bz2 whose text passes the auto-prepare bound",
        "train",
        {"data.auto_prepare_max_mb": "1"},
        data_file("many.txt.bz2", lambda: bz2.compress(b"the same line of text, again\n" * 80_000)),
        {},
        ["many.txt.bz2 (about 2.2 MB of text, 0.0 MB compressed)", "auto_prepare_max_mb = 1", "titan data prepare"],
    ),  # fmt: skip
    (
        "zst cut short",
        "train",
        {},
        data_file("web.jsonl.zst", zstandard.ZstdCompressor().compress(b'{"text": "a story"}\n' * 5000)[:-9]),
        {},
        ["web.jsonl.zst is damaged: it ends inside a zstd frame", "copy or compress it again"],
    ),  # fmt: skip
    (
        "saved dataset naming a file outside",
        "train",
        {},
        saved_dataset_naming("../elsewhere.arrow"),
        {},
        ["state.json: _data_files[0].filename must be a file name in its folder", "'../elsewhere.arrow'"],
    ),  # fmt: skip
    (
        "binary jsonl",
        "train",
        {},
        data_file("bin.jsonl", bytes(range(256)) * 8),
        {},
        ["bin.jsonl", "not a text file", "line 1"],
    ),  # fmt: skip
    (
        "malformed jsonl",
        "train",
        {},
        data_file("bad.jsonl", b'{"text": "a b"}\n{"text": broken\n'),
        {},
        ["bad.jsonl", "line 2 is not valid JSON"],
    ),  # fmt: skip
    ("binary text", "train", {}, data_file("bin.txt", bytes(range(256)) * 8), {}, ["bin.txt", "not a text file"]),
    (
        "all texts empty",
        "train",
        {},
        data_file("empty.jsonl", b'{"text": ""}\n{"text": "  "}\n'),
        {},
        ["empty.jsonl", "empty or whitespace"],
    ),  # fmt: skip
    ("empty file", "train", {}, data_file("nothing.jsonl", b""), {}, ["nothing.jsonl"]),
    # -- checkpoints
    (
        "resume path missing",
        "train",
        {"checkpoint.resume": "nowhere/step-3"},
        None,
        {},
        ["checkpoint.resume", "nowhere/step-3", "does not exist"],
    ),  # fmt: skip
    (
        "load_step missing",
        "train",
        {**SAVED, "checkpoint.load_step": "7"},
        None,
        {},
        ["checkpoint.load_step 7", "no complete checkpoint"],
    ),  # fmt: skip
    (
        "another model",
        "train",
        {"model.overrides.n_layers": "3"},
        resume_saved(),
        {},
        ["does not match", "parameters differ"],
    ),  # fmt: skip
    (
        "changed lr",
        "train",
        {},
        resume_saved(**{"optimizer.lr": "1e-4"}),
        {},
        ["optimizer.lr 0.003 -> 0.0001", "--checkpoint.allow_changes optimizer.lr"],
    ),  # fmt: skip
    (
        "changed seq_len",
        "train",
        {},
        resume_saved(**{"training.seq_len": "16"}),
        {},
        ["training.seq_len 32 -> 16"],
    ),  # fmt: skip
    ("flipped byte", "train", {}, damaged_checkpoint(flip_byte), {}, ["__0_0.distcp does not match its SHA-256"]),
    ("truncated shard", "train", {}, damaged_checkpoint(truncate), {}, ["__0_0.distcp has 1000 bytes"]),
    (
        "missing loader state",
        "train",
        {},
        damaged_checkpoint(lambda f: (f / "data.json").unlink()),
        {},
        ["data.json is missing"],
    ),  # fmt: skip
    (
        "missing manifest",
        "train",
        {},
        damaged_checkpoint(lambda f: (f / "manifest.json").unlink()),
        {},
        ["manifest.json is missing or unreadable"],
    ),  # fmt: skip
    (
        "an older titan's checkpoint",
        "train",
        {},
        damaged_checkpoint(as_written_by_an_older_titan),
        {},
        ["written by an older titan", "titan convert upgrade"],
    ),  # fmt: skip
    # -- faults
    (
        "output folder is a file",
        "train",
        {},
        output_is_a_file,
        {},
        ["job.output_dir", "a file stands where a folder is needed"],
    ),  # fmt: skip
    ("full disk", "train", {}, metrics_on_a_full_disk, {}, ["metrics.jsonl", "no space left on device"]),
    (
        "NaN loss",
        "train",
        {"optimizer.lr": "1e4", "training.steps": "10"},
        None,
        {},
        ["step", "nan", "lower learning rate"],
    ),  # fmt: skip
    (
        "validation source is the training source",
        "show",
        ["--data.source", "data/stories.jsonl", "--validation.source", "./data/stories.jsonl"],
        None,
        {},
        ["validation.source", "./data/stories.jsonl", "data.source", "trains on"],
    ),  # fmt: skip
    (
        "changed validation fraction",
        "train",
        {},
        resume_saved(**{"validation.fraction": "0.1"}),
        {},
        ["validation.fraction 0.05 -> 0.1", "--checkpoint.allow_changes validation.fraction"],
    ),  # fmt: skip
    (
        "changed data format",
        "train",
        {},
        resume_saved(**{"data.format": "json"}),
        {},
        ["data.format 'auto' -> 'json'", "--checkpoint.allow_changes data.format"],
    ),  # fmt: skip
    (
        "changed float8 skip",
        "train",
        {},
        resume_saved(**{"float8.skip": "output,w2"}),
        {},
        ["float8.skip ['output'] -> ['output', 'w2']"],
    ),  # fmt: skip
    # -- numbers that are not: every float of the recipe finite, but where infinity means no limit
    ("lr infinite", "show", ["--optimizer.lr", "inf"], None, {}, ["optimizer.lr must be a finite number", "inf"]),
    ("clip infinite", "show", ["--training.max_grad_norm", "inf"], None, {}, ["training.max_grad_norm", "finite"]),
    ("auto-prepare size NaN", "show", ["--data.auto_prepare_max_mb", "nan"], None, {},
     ["data.auto_prepare_max_mb must be a finite number", "nan"]),
    ("norm_eps NaN", "show", ["--model.overrides.norm_eps", "nan"], None, {},
     ["model.overrides.norm_eps must be a finite number", "nan"]),
    ("rope_theta NaN", "show", [], recipe_file("[model.overrides]\nrope_theta = nan\n"), {},
     ["model.overrides.rope_theta must be a finite number", "nan"]),
    ("recipe nested too deep", "show", [], recipe_file("a = " + "[" * 5000 + "]" * 5000 + "\n"), {},
     ["recipe.toml is not valid TOML", "nests tables or arrays more than 32 deep"]),
    # -- a checkpoint's data position (data.json), crafted with a manifest to match
    ("data position negative", "train", {}, damaged_checkpoint(with_values("data.json", next_sample=-8)),
     {}, ["corrupt", "data.json: next_sample must be an integer in [0, 2^62]", "-8"]),
    ("data position infinite", "train", {}, damaged_checkpoint(with_values("data.json", next_sample=math.inf)),
     {}, ["corrupt", "data.json: next_sample must be an integer", "inf"]),
    ("data position huge", "train", {}, damaged_checkpoint(with_values("data.json", next_sample=10**30)),
     {}, ["corrupt", "data.json: next_sample must be an integer in [0, 2^62]"]),
    ("data position as text", "train", {}, damaged_checkpoint(with_values("data.json", next_sample="16")),
     {}, ["corrupt", "data.json: next_sample must be an integer", "'16'"]),
    ("data order as a bool", "train", {}, damaged_checkpoint(with_values("data.json", order=True)),
     {}, ["corrupt", "data.json: order must be an integer", "True"]),
    ("data position a list", "train", {}, damaged_checkpoint(edit_json("data.json", lambda d: [d])), {},
     ["corrupt", "data.json must be an object", "[{"]),
    # -- mixtures of experts
    ("moe top_k above its experts", "show", ["--model.name", "moe", "--model.overrides.top_k", "9"], None, {},
     ["top_k (9) cannot exceed n_experts (8)"]),
    ("moe key on a dense flavor", "train", {"model.overrides.n_experts": "8"}, None, {},
     ["model.overrides.n_experts", "belongs to the moe family, not to llama3: set model.name = 'moe'"]),
    ("moe score function", "show", ["--model.name", "moe", "--model.overrides.score_func", "relu"], None, {},
     ["score_func must be one of softmax, sigmoid, got 'relu'"]),
    ("multi-token prediction weight negative", "show", ["--model.name", "moe", "--model.overrides.mtp_loss_weight",
     "-0.3"], None, {}, ["mtp_loss_weight must be a finite number >= 0, got -0.3"]),
    # -- expert parallelism (ranks taken from dp_shard x cp)
    ("zero ep", "show", ["--parallel.ep", "0"], None, {}, ["parallel.ep must be >= 1"]),
    ("ep not dividing the experts", "show", ["--model.name", "moe", "--parallel.ep", "3"], None, {"WORLD_SIZE": "3"},
     ["parallel.ep = 3", "divide the model's n_experts (8)"]),
    ("ep not dividing dp_shard", "show", ["--model.name", "moe", "--parallel.ep", "4"], None, {"WORLD_SIZE": "2"},
     ["parallel.ep = 4", "must divide dp_shard x cp = 2 x 1", "launch more processes"]),
    ("ep on a dense model", "show", ["--parallel.ep", "2"], None, {"WORLD_SIZE": "2"},
     ["parallel.ep = 2", "llama3 family", "dense", "use parallel.ep = 1"]),
    ("ep not a multiple of cp", "show", ["--model.name", "moe", "--parallel.cp", "4", "--parallel.ep", "2"], None,
     {"WORLD_SIZE": "8"}, ["parallel.ep = 2 must be a multiple of parallel.cp = 4"]),
    ("ep without data parallelism", "show", ["--model.name", "moe", "--parallel.cp", "2", "--parallel.ep", "2"],
     None, {"WORLD_SIZE": "2"}, ["parallel.ep = 2 without data parallelism", "not supported yet", "dp_shard >= 2"]),
    ("planned expert load below the mean", "show", ["--plan.moe_load_imbalance", "0.5"], None, {},
     ["plan.moe_load_imbalance must be >= 1", "got 0.5"]),
    ("tokens batching with the balance loss", "show", ["--model.name", "moe", "--data.batching", "tokens"], None, {},
     ["does not support the balance loss", "each row's tokens", "set aux_loss_coef to 0 (the bias balances alone)"]),
    ("tp not dividing the shared experts", "show", ["--model.name", "moe", "--parallel.tp", "2",
     "--model.overrides.n_shared_experts", "1", "--model.overrides.expert_hidden_dim", "177"], None,
     {"WORLD_SIZE": "2"}, ["parallel.tp = 2 must divide the model's shared experts' width (1 x 177)"]),
    ("latent attention's heads not dividing by tp", "show", ["--model.name", "moe", "--model.overrides.kv_lora_rank",
     "32", "--parallel.tp", "3"], None, {"WORLD_SIZE": "3"},
     ["parallel.tp = 3 must divide the model's n_heads (8)", "splits latent attention by heads"]),
    ("unknown text unit", "show", ["--data.text_unit", "sentence"], None, {},
     ["data.text_unit", "'paragraph'", "sentence"]),
    # -- dtypes: titan's names and torch's
    ("dtype in neither spelling", "show", ["--training.mixed_precision", "half"], None, {},
     ["training.mixed_precision must be one of fp32, bf16", "'bf16' is 'bfloat16'", "got 'half'"]),
    # -- TorchTitan's names for keys: titan's, not the nearest spelling (training.dataset is near training.steps)
    *[(f"TorchTitan's {key}", "show", [f"--{key}", "1"], None, {},
       [f"'{key}'", f"TorchTitan's name; titan's is {ours}"]) for key, ours in {
          "training.dataset": "data.source", "training.dataset_path": "data.source",
          "training.compile": "compile.enable", "job.dump_folder": "job.output_dir",
          "training.batch_size": "training.local_batch_size", "training.max_norm": "training.max_grad_norm",
          "training.warmup_steps": "lr_scheduler.warmup_steps", "checkpoint.folder": "job.output_dir",
          "parallelism.data_parallel_shard_degree": "parallel.dp_shard",
          "parallelism.tensor_parallel_degree": "parallel.tp",
          "parallelism.pipeline_parallel_degree": "parallel.pp", "parallelism.context_parallel_degree": "parallel.cp",
          "parallelism.expert_parallel_degree": "parallel.ep", "metrics.enable_wandb": "metrics.wandb",
          "metrics.enable_tensorboard": "metrics.tensorboard",
      }.items()],
    ("TorchTitan's section in a recipe", "show", [], recipe_file("[parallelism]\ntensor_parallel_degree = 2\n"), {},
     ["'parallelism.tensor_parallel_degree'", "TorchTitan's name; titan's is parallel.tp"]),
    # -- titan tokenizer train
    ("tokenizer train without a source", "cli", ["tokenizer", "train"], tokenizer_out, {}, ["--data SOURCE"]),
    ("tokenizer train on a missing source", "cli", ["tokenizer", "train", "--data", "missing/b.jsonl"], tokenizer_out,
     {}, ["data.source", "not found", "missing/b.jsonl"]),
    ("tokenizer train on empty documents", "cli", ["tokenizer", "train"], empty_documents, {},
     ["empty.jsonl holds no text to train a tokenizer on"]),
    ("tokenizer vocabulary too small", "cli", ["tokenizer", "train", "--data", "data/stories.jsonl", "--vocab-size",
     "100"], tokenizer_out, {}, ["--vocab-size 100", "at least 258"]),
    ("tokenizer vocabulary of a billion", "cli", ["tokenizer", "train", "--data", "data/stories.jsonl",
     "--vocab-size", "1000000000"], tokenizer_out, {}, ["--vocab-size 1,000,000,000", "more than titan's models take"]),
    ("tokenizer min-frequency negative", "cli", ["tokenizer", "train", "--data", "data/stories.jsonl",
     "--min-frequency", "-1"], tokenizer_out, {}, ["--min-frequency -1", "give 1 or more"]),
    # -- titan eval (on the saved checkpoint)
    ("eval of a task file that runs code", "cli", ["eval", "--tasks", "sneaky"], task_running_code, {},
     ["a task file is code", "sneaky.yaml: process_docs: !function os.system", "--allow-task-code"]),
    ("eval of a hub task without network", "cli", ["eval", "--tasks", "hellaswag", "--limit", "2"], saved_checkpoint,
     {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": "/nonexistent/titan-datasets"},
     ["--tasks hellaswag: could not fetch a task's dataset", "--include-path"]),
    ("eval of nothing", "cli", ["eval"], saved_checkpoint, {}, ["give --data SOURCE", "or --tasks NAMES"]),
    ("eval of no task", "cli", ["eval", "--tasks", " , "], saved_checkpoint, {}, ["--tasks names no task"]),
    ("eval --seq-len above the model's", "cli", ["eval", "--data", "data/stories.jsonl", "--seq-len", "4096"],
     saved_checkpoint, {}, ["--seq-len 4096", "max_seq_len 2048"]),
    ("eval --batches negative", "cli", ["eval", "--data", "data/stories.jsonl", "--batches", "-1"], saved_checkpoint,
     {}, ["--batches must be >= 0"]),
    ("eval --text-unit unknown", "cli", ["eval", "--data", "data/stories.jsonl", "--text-unit", "page"],
     saved_checkpoint, {}, ["data.text_unit", "'paragraph'", "page"]),
    ("eval on a missing source", "cli", ["eval", "--data", "missing/held.jsonl"], saved_checkpoint, {},
     ["data.source", "not found", "missing/held.jsonl"]),
    ("eval of an unknown task", "cli", ["eval", "--tasks", "no_such_task"], saved_checkpoint, {},
     ["--tasks: no_such_task is no lm-eval task", "--include-path"]),
    ("eval with a missing task folder", "cli", ["eval", "--tasks", "mine", "--include-path", "missing/tasks"],
     saved_checkpoint, {}, ["--include-path missing/tasks: no such folder"]),
    # -- what a run reads: named by the recipe, never a test file by default
    ("recipe without a tokenizer", "show", [], recipe_file('[data]\nsource = "data/stories.jsonl"\n'), {},
     ["the recipe names no tokenizer: set tokenizer.path", "a model folder or a hub name"]),
    ("recipe without data", "show", [], recipe_file('[tokenizer]\npath = "data/tokenizer.json"\n'), {},
     ["the recipe names no data: set data.source", "[[data.sources]]"]),
    ("train without a tokenizer", "train", {"tokenizer.path": ""}, None, {},
     ["the recipe names no tokenizer: set tokenizer.path"]),
    ("init_from_hf of a hub model not downloaded", "train", {"checkpoint.init_from_hf": "acme/not-downloaded"}, None,
     {"HF_HUB_CACHE": "/nonexistent"}, ["checkpoint.init_from_hf: acme/not-downloaded is no folder",
     "nor a hub model in the local HF cache", "titan download acme/not-downloaded --weights"]),
    ("init_from_hf of a model whose tokenizer outnumbers its embedding", "train", {}, hf_model_with_a_larger_tokenizer,
     {}, ["tokenizer has 2049 tokens", "vocab_size is 2048"]),
    ("negative step timeout", "show", ["--fault.step_timeout_s", "-1"], None, {},
     ["fault.step_timeout_s must be seconds >= 0", "-1"]),
    ("zero collective timeout", "show", ["--fault.collective_timeout_s", "0"], None, {},
     ["fault.collective_timeout_s must be seconds > 0"]),
    ("negative spike threshold", "show", ["--replay.spike_zscore", "-1"], None, {},
     ["replay.spike_zscore must be >= 0 (0: off)", "got -1"]),
    ("spike window too short", "show", ["--replay.spike_window", "2"], None, {},
     ["replay.spike_window must be >= 3 steps", "got 2"]),
    ("snapshots without the node's shared memory", "train", {"fault.snapshot_interval": "1"}, None,
     {"TITAN_SNAPSHOT_DIR": "/nonexistent/shm"}, ["fault.snapshot_interval needs host shared memory (/nonexistent/shm)",
     "set $TITAN_SNAPSHOT_DIR to a folder in it"]),
    ("torchrun restarts on its shared store", "train", {}, None,
     {"WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"},
     ["torchrun --max-restarts with its shared store", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]),
    ("spike replay without digests or snapshots", "show", ["--replay.on_spike", "true", "--replay.spike_zscore", "5",
     "--fault.snapshot_interval", "0"], None, {},
     ["replay.on_spike replays a spiked step",
      "needs replay.digests = true, fault.snapshot_interval > 0; set them, or replay.on_spike = false"]),
    ("spike replay with straggler re-plans", "show", ["--replay.on_spike", "true", "--replay.digests", "true",
     "--replay.spike_zscore", "5", "--fault.snapshot_interval", "1", "--straggler.enable", "true"], None, {},
     ["it needs straggler.enable = false; set it, or replay.on_spike = false"]),
    ("snapshot interval neither steps nor auto", "show", ["--fault.snapshot_interval", "sometimes"], None, {},
     ["fault.snapshot_interval must be int | 'auto'", "got 'sometimes'"]),
    ("negative snapshot interval", "show", ["--fault.snapshot_interval", "-1"], None, {},
     ["fault.snapshot_interval must be steps >= 0 (0: off) or 'auto'", "got -1"]),
    ("negative snapshot overhead", "show", ["--fault.snapshot_overhead", "-0.1"], None, {},
     ["fault.snapshot_overhead must be a fraction of the step time > 0", "got -0.1"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def saved() -> Path:
    return trained_run(**SAVED) / "debug" / "checkpoints" / "step-2"


def case_run(case, tmp: Path, saved: Path) -> tuple[list[str], dict]:
    """The CLI arguments and environment of a case."""
    _, command, overrides, setup, env, _ = case
    tmp.mkdir()
    extra = setup(tmp, saved) if setup else {}
    config = extra.pop("--config", str(DEBUG_RECIPE))
    if command == "show":
        return ["config", "show", "--config", config, *overrides], env
    if command == "cli":  # another command: its arguments, then the setup's options
        return [*overrides, *(item for option in extra.items() for item in option)], env
    return ["train", "--config", config, *tiny_overrides(tmp, **{**SMALL, **overrides, **extra})], env


@pytest.fixture(scope="module")
def results(tmp_path_factory, saved) -> dict:
    """Every case's CLI run, three at a time, each in a process forked from one that imported torch once (most
    of a fresh run is that import). A recipe refused without importing torch is tested on its own below."""
    root = tmp_path_factory.mktemp("cases")
    runs = [case_run(c, root / f"case{i}", saved) for i, c in enumerate(CASES)]
    return {c[0]: result for c, result in zip(CASES, run_titan_many(runs))}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_line_and_exit_2(results, case):
    assert_one_line_error(results[case[0]], *case[-1])


@pytest.mark.parametrize(
    "command, override, words",
    [
        ("show", ("--training.step", "3"), ("training.step", "did you mean training.steps")),
        ("train", ("--model.flavor", "9B"), ("unknown model.flavor '9B'", "flavors: debug")),
        ("train", ("--model.overrides.n_heads", "7"), ("must divide by n_heads (7)",)),
        ("train", ("--model.overrides.n_experts", "8"), ("n_experts belongs to the moe family",)),
        (
            "train",
            ("--data.source", "missing/books.jsonl"),
            ("data.source: file or folder not found: missing/books.jsonl",),
        ),
        ("train", ("--tokenizer.path", "missing/tok.json"), ("tokenizer.path: file not found: missing/tok.json",)),
    ],
    ids=[
        "key typo",
        "unknown flavor",
        "model that cannot be built",
        "MoE key on a dense flavor",
        "missing data",
        "missing tokenizer",
    ],  # fmt: skip
)
def test_a_refused_recipe_exits_without_importing_torch(command, override, words):
    """Through a fresh interpreter, as a user runs it: a recipe error is found before torch's ~2-4 s import."""
    args = ("config", "show") if command == "show" else ("train",)
    result = run_titan(*args, "--config", str(DEBUG_RECIPE), *override, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert_one_line_error(result, *words)
    assert "titan.config" in imported_modules(result) and "torch" not in imported_modules(result)


@pytest.mark.parametrize(
    "recipe, override, words",
    [
        ("debug", (), ()),
        ("debug_moe", (), ()),
        ("debug", ("--parallel.tp", "3"), ("parallel.tp = 3 must divide the model's n_heads (8)",)),
        ("debug", ("--parallel.pp_schedule", "Zigzag"), ("parallel.pp_schedule: Unknown schedule name 'Zigzag'",)),
        (
            "debug",
            ("--parallel.pp", "2", "--parallel.pp_schedule", "1F1B", "--parallel.pp_stages_per_rank", "2"),
            ("parallel.pp_schedule 1F1B runs one stage per rank",),
        ),
        (
            "debug_moe",
            ("--parallel.pp", "2", "--parallel.pp_stage_memory_gib", "[0.001, 0.001]"),
            ("parallel.pp_stage_memory_gib [0.001, 0.001]: no split", "GiB of weights"),
        ),
    ],
    ids=["llama", "moe", "tp", "schedule name", "stages per rank", "stage memory"],
)
def test_config_show_checks_the_model_and_layout_without_importing_torch(recipe, override, words):
    """The layout's checks and the blocks' memory are worked out from the model's args: torch loads only for what
    asks about the device (and for training or tracing)."""
    path = ROOT / "recipes" / f"{recipe}.toml"
    result = run_titan("config", "show", "--config", str(path), *override, env={"PYTHONPROFILEIMPORTTIME": "1"})
    if words:
        assert_one_line_error(result, *words)
    else:
        assert result.returncode == 0 and "[parallel]" in result.stdout, result.stderr[-2000:]
    assert "titan.config" in imported_modules(result) and "torch" not in imported_modules(result)


def test_the_table_covers_every_area():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


# Checks that once ran after the process group was joined. Rank 0 of 2 whose partner never comes: joining would
# wait TITAN_DIST_TIMEOUT_S and fail with a traceback, so the one line shows the check ran before it.
BEFORE_JOINING = [
    (
        "tokens batching with dropout",
        {"data.batching": "tokens", "model.overrides.resid_dropout": "0.1"},
        ["does not support dropout", "resid_dropout"],
    ),
    (
        "one-stage schedule with two stages per rank",
        {"parallel.pp": "2", "parallel.pp_schedule": "1F1B", "parallel.pp_stages_per_rank": "2",
         "model.overrides.n_layers": "4"},
        ["parallel.pp_schedule 1F1B runs one stage per rank", "parallel.pp_stages_per_rank = 1"],
    ),
    (
        "tokenizer larger than the model's vocabulary",
        {"model.overrides.vocab_size": "100"},
        ["tokenizer has", "vocab_size is 100"],
    ),
    ("nccl on the CPU", {"parallel.backend": "nccl"}, ["parallel.backend = 'nccl' needs CUDA GPUs"]),
    ("seq_len above the model's", {"training.seq_len": "4096"}, ["training.seq_len 4096", "max_seq_len 2048"]),
    (
        "auto checkpointing with no routed block on rank 0",
        {"model.name": "moe", "model.flavor": "debug", "parallel.pp": "2", "parallel.pp_layers_per_stage": "[1, 3]",
         "activation_checkpoint.mode": "auto", "activation_checkpoint.budget_gib": "1"},
        ["whose layers [0] hold no routed block", "parallel.pp_layers_per_stage"],
    ),
]  # fmt: skip


@pytest.mark.parametrize("overrides,words", [c[1:] for c in BEFORE_JOINING], ids=[c[0] for c in BEFORE_JOINING])
def test_a_recipe_is_refused_before_the_process_group_is_joined(tmp_path, overrides, words):
    from distributed import free_port

    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "TITAN_DIST_TIMEOUT_S": "5"}  # fmt: skip
    result = run_titan("train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **overrides), env=env)
    assert_one_line_error(result, *words)


SHOWN = [c for c in BEFORE_JOINING if "tokenizer" not in c[0]]


@pytest.mark.parametrize("overrides,words", [c[1:] for c in SHOWN], ids=[c[0] for c in SHOWN])
def test_config_show_refuses_what_train_refuses_before_joining(overrides, words):
    """The recipe's checks are the pre-flight's, which `titan config show` runs too (the tokenizer's file is read by
    the run alone)."""
    flags = [item for key, value in overrides.items() for item in (f"--{key}", value)]
    result = run_titan("config", "show", "--config", str(DEBUG_RECIPE), *flags, env={"WORLD_SIZE": "2"})
    assert_one_line_error(result, *words)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "overrides,words",
    [
        ({"parallel.tp": "3"}, ["tp=3", "world size 2"]),  # found by every rank before joining the others
        ({"job.output_dir": "afile"}, ["job.output_dir", "a file stands"]),  # found by rank 0, told to the others
    ],
    ids=["every rank", "rank 0"],
)
def test_under_torchrun_the_line_is_printed_once_and_every_rank_exits_2(tmp_path, overrides, words):
    (tmp_path / "afile").write_text("")
    if "job.output_dir" in overrides:
        overrides = {"job.output_dir": str(tmp_path / "afile")}
    result = torchrun(2, ["train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **{**SMALL, **overrides})])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), result.stderr
    assert f'File "{ROOT / "titan"}' not in result.stderr  # no traceback from titan on any rank
    assert result.stderr.count("exitcode  : 2") == 2, result.stderr[-2000:]  # torchrun's summary of each rank


# -- crafted checkpoints: a folder someone shares, made to run code, read outside itself or exhaust memory.
# Every case goes through each command that reads a checkpoint; the payloads would create the file `ran`.


def _text(value: str) -> bytes:
    return b"\x8c" + bytes([len(value.encode())]) + value.encode()  # SHORT_BINUNICODE


def _calls(module: str, name: str, arg: str) -> bytes:
    """Pickle opcodes calling module.name(arg): STACK_GLOBAL (protocol 4 reads a dotted name as an attribute
    chain), the argument, TUPLE1, REDUCE."""
    return _text(module) + _text(name) + b"\x93" + _text(arg) + b"\x85R"


def _command(marker: Path) -> str:
    return f"touch {marker}"


def legacy_pickle(payload):
    """An older titan's checkpoint (`.metadata`, no tensors.json) whose pickle is `payload(marker)`."""

    def damage(folder: Path, marker: Path) -> None:
        pickled = payload(marker)
        (folder / INDEX).unlink()
        (folder / ".metadata").write_bytes(pickled)
        reseal(folder)

    return damage


def legacy_call(module: str, name: str):
    return legacy_pickle(lambda marker: b"\x80\x04" + _calls(module, name, _command(marker)) + b".")


def hostile_build(marker: Path) -> bytes:
    """BUILD on an admitted class (TensorProperties.__setstate__) with a state whose making runs a command."""
    admitted = _text("torch.distributed.checkpoint.metadata") + _text("TensorProperties") + b"\x93"
    return b"\x80\x04" + admitted + b")\x81" + _calls("torch", "os.system", _command(marker)) + b"b."


def legacy_metadata(change):
    """An older titan's index made of DCP's own classes, as its pickle held them, after `change(metadata)`."""

    return legacy_pickle(
        lambda marker: pickle.dumps(change(CheckpointReader(marker.parent / "step-2").read_metadata()))
    )


def with_bytes_entry(metadata):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata.state_dict_metadata["model.norm.weight"] = BytesStorageMetadata()
    return metadata


def with_path_outside(metadata):
    for info in metadata.storage_data.values():
        info.relative_path = "../../outside.distcp"
    return metadata


def edit_index(edit):
    """The index changed by `edit(index, folder, marker)`, the manifest rewritten to match."""

    def damage(folder: Path, marker: Path) -> None:
        index = json.loads((folder / INDEX).read_text())
        edit(index, folder, marker)
        (folder / INDEX).write_text(json.dumps(index))
        reseal(folder)

    return damage


def first_chunk(index: dict) -> dict:
    return index["tensors"]["model.tok_embeddings.weight"]["chunks"][0]


def declare_huge(index, folder, marker) -> None:
    entry = index["tensors"]["model.tok_embeddings.weight"]
    entry["shape"], entry["chunks"][0]["offsets"], entry["chunks"][0]["sizes"] = [10**12], [0], [10**12]


def point_past_the_end(index, folder, marker) -> None:
    first_chunk(index)["start"] = (folder / "__0_0.distcp").stat().st_size - 10


def leave_a_hole(index, folder, marker) -> None:
    first_chunk(index)["sizes"][0] //= 2


def shard_that_runs_code(index, folder, marker) -> None:
    """A shard file whose torch.save pickle calls os.system (DCP reads shards with weights_only=True)."""

    class RunsACommand:
        def __reduce__(self):
            return (os.system, (_command(marker),))

    torch.save({"weight": RunsACommand(), "padding": b"0" * 600_000}, folder / "__0_1.distcp")
    first_chunk(index).update(file="__0_1.distcp", start=0, length=(folder / "__0_1.distcp").stat().st_size)


def unlisted_shard(folder: Path, marker: Path) -> None:
    edit_index(lambda index, *_: first_chunk(index).update(file="__9_0.distcp"))(folder, marker)
    shutil.copy(folder / "__0_0.distcp", folder / "__9_0.distcp")  # after the manifest was written


def edit_manifest(edit):
    def damage(folder: Path, marker: Path) -> None:
        manifest = json.loads((folder / MANIFEST).read_text())
        edit(manifest["files"])
        (folder / MANIFEST).write_text(json.dumps(manifest))

    return damage


def symlinked(name: str):
    """`name` moved out of the folder and linked back (its sums pass: they are of the file linked to)."""

    def damage(folder: Path, marker: Path) -> None:
        outside = folder.parent / f"outside-{name}"
        (folder / name).rename(outside)
        (folder / name).symlink_to(outside)
        reseal(folder)

    return damage


def same_half_twice(index, folder, marker) -> None:
    """Two chunks over the embedding's first half: their elements add up to the tensor's, its second half is in
    none of them."""
    entry = index["tensors"]["model.tok_embeddings.weight"]
    half = {**entry["chunks"][0], "sizes": [entry["shape"][0] // 2, entry["shape"][1]]}
    entry["chunks"] = [half, dict(half)]


def inflating_chunk(index, folder, marker) -> None:
    """The final norm's 64 floats as a view of a 2^24-float storage (64 MiB) whose record is deflated to ~64 KB."""
    plain = io.BytesIO()
    torch.save(torch.zeros(2**24)[:64], plain)
    with zipfile.ZipFile(plain) as saved, zipfile.ZipFile(folder / "__0_1.distcp", "w") as packed:
        for info in saved.infolist():
            packed.writestr(info.filename, saved.read(info), zipfile.ZIP_DEFLATED)
    chunk = index["tensors"]["model.norm.weight"]["chunks"][0]
    chunk.update(file="__0_1.distcp", start=0, length=(folder / "__0_1.distcp").stat().st_size)


def build_on_a_class(marker: Path) -> bytes:
    """BUILD on the admitted class PosixPath, setting its is_symlink to torch.Size (whose empty call is falsy: no
    path would read as a link for the rest of the process), then the checkpoint's true index."""
    metadata = CheckpointReader(marker.parent / "step-2").read_metadata()
    state = b"N}" + _text("is_symlink") + _text("torch") + _text("Size") + b"\x93s\x86"  # (None, {name: value})
    sets = _text("pathlib") + _text("PosixPath") + b"\x93" + state + b"b0"  # BUILD, POP
    return b"\x80\x04" + sets + pickle.dumps(metadata, protocol=2)[2:]


def replace_index(payload):
    def damage(folder: Path, marker: Path) -> None:
        (folder / INDEX).write_bytes(payload(marker))
        reseal(folder)

    return damage


OLDER = ["written by an older titan", "titan convert upgrade"]
# (id, damage(folder, marker), words of resume / dcp-to-hf / generate, words of `convert upgrade` or None)
CRAFTED = [
    ("dotted name through DCP's metadata module", legacy_call("torch.distributed.checkpoint.metadata", "os.system"),
     OLDER, ["not trusted", "torch.distributed.checkpoint.metadata.os.system is not part of a DCP index"]),
    ("dotted name through torch", legacy_call("torch", "os.system"), OLDER, ["not trusted", "torch.os.system"]),
    ("dotted name through torch.serialization", legacy_call("torch.serialization", "os.system"), OLDER,
     ["not trusted", "torch.serialization.os.system"]),
    ("dotted name through pathlib", legacy_call("pathlib", "os.system"), OLDER, ["not trusted", "pathlib.os.system"]),
    ("attribute chain through an admitted function", legacy_call("torch.serialization", "_get_layout.__globals__"),
     OLDER, ["not trusted", "_get_layout.__globals__"]),
    ("os.system", legacy_call("os", "system"), OLDER, ["not trusted", "os.system"]),
    ("builtins.eval", legacy_call("builtins", "eval"), OLDER, ["not trusted", "builtins.eval"]),
    ("BUILD with a state that runs code", legacy_pickle(hostile_build), OLDER, ["not trusted", "torch.os.system"]),
    ("bytes entry in a pickled index", legacy_metadata(with_bytes_entry), OLDER,
     ["not trusted", "BytesStorageMetadata"]),
    ("pickled index naming a file outside", legacy_metadata(with_path_outside), OLDER,
     ["corrupt", "'../../outside.distcp', which is not a shard file"]),
    ("bytes entry", edit_index(lambda index, *_: index["tensors"].update({"model.norm.weight": {
        "type": "bytes", "file": "__0_0.distcp", "start": 0, "length": 10}})), ["corrupt", "is not a tensor"], None),
    ("10^12 elements", edit_index(declare_huge), ["corrupt", "declares 1000000000000 elements"], None),
    ("chunk past the end of its file", edit_index(point_past_the_end), ["corrupt", "spans bytes"], None),
    ("chunk longer than its file", edit_index(lambda index, *_: first_chunk(index).update(length=10**15)),
     ["corrupt", "spans bytes"], None),
    ("chunks leaving a hole", edit_index(leave_a_hole), ["corrupt", "chunks of 65536 elements"], None),
    ("relative path leaving the folder", edit_index(lambda index, *_: first_chunk(index).update(file="../../x.distcp")),
     ["corrupt", "'../../x.distcp', which is not a shard file"], None),
    ("absolute path", edit_index(lambda index, *_: first_chunk(index).update(file="/etc/passwd")),
     ["corrupt", "'/etc/passwd', which is not a shard file"], None),
    ("unknown dtype", edit_index(lambda index, *_: index["tensors"]["model.norm.weight"].update(dtype="object")),
     ["corrupt", "dtype 'object'"], None),
    ("index of a future version", edit_index(lambda index, *_: index.update(version=2)),
     ["corrupt", "version 2", "upgrade titan"], None),
    ("pickle in the index's place", replace_index(lambda m: b"\x80\x04" + _calls("os", "system", _command(m)) + b"."),
     ["corrupt", "tensors.json is not JSON"], None),
    ("shard whose pickle runs code", edit_index(shard_that_runs_code), ["corrupt", "Weights only load failed"], None),
    ("symlinked shard file", symlinked("__0_0.distcp"), ["__0_0.distcp is a symbolic link"], None),
    ("symlinked index", symlinked(INDEX), ["tensors.json is a symbolic link"], None),
    ("shard file the manifest does not list", unlisted_shard, ["__9_0.distcp is not listed in manifest.json"], None),
    ("manifest listing a missing file", edit_manifest(lambda files: files.update({"__1_0.distcp": files["data.json"]})),
     ["__1_0.distcp is missing"], None),
    ("manifest listing a path outside", edit_manifest(lambda files: files.update({"../../etc/passwd": files[INDEX]})),
     ["manifest.json lists '../../etc/passwd', which is not a file name of a checkpoint"], None),
    # The next-step mark is outside the manifest, but no less a plain file of the folder.
    ("symlinked next-step mark", lambda folder, _: (folder / PROVEN).symlink_to(folder / "data.json"),
     [f"{PROVEN} is a symbolic link"], None),
    ("manifest listing the next-step mark", edit_manifest(lambda files: files.update({PROVEN: files["data.json"]})),
     [f"manifest.json lists '{PROVEN}', which is not a file name of a checkpoint"], None),
    ("chunks over the same half", edit_index(same_half_twice), ["corrupt", "overlap"], None),
    ("chunk whose storage inflates", edit_index(inflating_chunk), ["corrupt", "compressed"], None),
    ("BUILD on an admitted class", legacy_pickle(build_on_a_class), OLDER, ["not trusted", "pathlib.PosixPath"]),
    # train_state.json: every reader checks all of it (a crafted file is corrupt whoever reads it)
    ("step as text", with_values("train_state.json", step="2"),
     ["corrupt", "train_state.json: step must be an integer in [0, 2^62], got '2'"], None),
    ("negative step", with_values("train_state.json", step=-5),
     ["corrupt", "train_state.json: step must be an integer in [0, 2^62], got -5"], None),
    ("step a bool", with_values("train_state.json", step=True),
     ["corrupt", "train_state.json: step must be an integer", "got True"], None),
    ("step of 10^30", with_values("train_state.json", step=10**30),
     ["corrupt", "train_state.json: step must be an integer in [0, 2^62]"], None),
    ("tokens seen NaN", with_values("train_state.json", tokens_seen=math.nan),
     ["corrupt", "train_state.json: tokens_seen must be an integer", "nan"], None),
    ("loss as text", with_values("train_state.json", loss="low"),
     ["corrupt", "train_state.json: loss must be a number or null, got 'low'"], None),
    ("no lr schedule", edit_json("train_state.json", lambda s: {k: v for k, v in s.items() if k != "lr_scheduler"}),
     ["corrupt", "train_state.json has no 'lr_scheduler'"], None),
    ("lr schedule position as text", with_values("train_state.json", lr_scheduler={"last_epoch": "2"}),
     ["corrupt", "train_state.json: lr_scheduler.last_epoch must be an integer in [-1, 2^62], got '2'"], None),
    ("model shapes a list", edit_json("train_state.json", lambda s: {**s, "model": {**s["model"], "shapes": []}}),
     ["corrupt", "train_state.json: model.shapes must be an object, got []"], None),
    ("model without a name", with_values("train_state.json", model={"flavor": "debug", "shapes": {}}),
     ["corrupt", "train_state.json: model has no 'name'"], None),
    ("recipe not text", with_values("train_state.json", recipe=5),
     ["corrupt", "train_state.json: recipe must be a string, got 5"], None),
    ("re-plan a list", with_values("train_state.json", plan=[1.0, 0.5]),
     ["corrupt", "train_state.json: plan must be an object"], None),
    ("re-plan on an unknown layout", with_values("train_state.json", plan={"dp_weights": [1.0, 0.5],
     "measured_on": {"layout": {"xp": 2}, "devices": ["a:0", "a:1"]}}),
     ["corrupt", "train_state.json: plan.measured_on.layout has 'xp', which is none of dp_replicate"], None),
    ("train state nested too deep", edit_json("train_state.json", lambda _: "[" * 10**5 + "]" * 10**5),
     ["corrupt", "train_state.json is not JSON titan reads: nested deeper than"], None),
]  # fmt: skip
READERS = ("resume", "dcp-to-hf", "generate")


def crafted_run(case, command: str, tmp: Path, saved: Path) -> tuple[list[str], dict]:
    """The CLI run of `command` on the case's crafted copy of the saved checkpoint, in a folder of its own."""
    _, damage, _, _ = case
    tmp.mkdir(parents=True)
    folder = tmp / "step-2"
    shutil.copytree(saved, folder)
    damage(folder, tmp / "ran")
    if command == "resume":
        overrides = tiny_overrides(tmp, **{**SMALL, **SAVED, "checkpoint.resume": str(folder)})
        return ["train", "--config", str(DEBUG_RECIPE), *overrides], {}
    if command == "dcp-to-hf":
        return ["convert", "dcp-to-hf", str(folder), str(tmp / "hf")], {}
    if command == "generate":
        return ["generate", "--checkpoint", str(folder), "--prompt", "Once upon a time"], {}
    return ["convert", "upgrade", str(folder)], {}


@pytest.fixture(scope="module")
def crafted_results(tmp_path_factory, saved) -> dict:
    root = tmp_path_factory.mktemp("crafted")
    keys = [(i, command) for i, case in enumerate(CRAFTED) for command in (*READERS, "upgrade")[: 3 + bool(case[3])]]
    runs = [crafted_run(CRAFTED[i], command, root / f"case{i}-{command}", saved) for i, command in keys]
    results = run_titan_many(runs)
    return {key: (result, root / f"case{key[0]}-{key[1]}" / "ran") for key, result in zip(keys, results)}


@pytest.mark.parametrize("index", range(len(CRAFTED)), ids=[c[0] for c in CRAFTED])
def test_a_crafted_checkpoint_runs_nothing_and_is_one_line(crafted_results, index):
    _, _, words, upgrade_words = CRAFTED[index]
    for command in (*READERS, "upgrade")[: 3 + bool(upgrade_words)]:
        result, ran = crafted_results[(index, command)]
        assert not ran.exists(), f"{command} ran the checkpoint's code"
        assert_one_line_error(result, *(upgrade_words if command == "upgrade" else words))


def test_the_crafted_table_covers_every_way_in():
    assert len(CRAFTED) >= 15 and len({c[0] for c in CRAFTED}) == len(CRAFTED)


# -- crafted folders titan reads besides a checkpoint's tensors: a run folder (`titan compare`), an HF folder
# (`convert hf-to-dcp`, checkpoint.init_from_hf), the recipe a checkpoint saved (`convert dcp-to-hf`, generate),
# and generate's own options. Every case goes through each command that reads its folder.


def file_text(name: str, text: str):
    """Damage: the folder's file `name` holds `text`."""
    return lambda folder: (folder / name).write_text(text)


def edit_file(name: str, edit):
    """Damage: the folder's JSON file `name` is `edit(its content)`."""
    return lambda folder: (folder / name).write_text(json.dumps(edit(json.loads((folder / name).read_text()))))


def edit_weight_map(edit):
    return edit_file("model.safetensors.index.json", lambda index: {**index, "weight_map": edit(index["weight_map"])})


def linked_out(name: str, target: Path | None):
    """Damage: the HF folder's file `name` a link to `target` (None: to a copy of the file beside the folder)."""

    def damage(folder: Path) -> None:
        to = target
        if to is None:
            to = folder.parent / f"copy-of-{name}"
            shutil.copyfile(folder / name, to)
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(to)

    return damage


def moved_out(absolute: bool):
    """Damage: the HF folder's first weights file moved to another model's folder beside it, the index naming it
    there (by a relative path, or an absolute one)."""

    def damage(folder: Path) -> None:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        name = min(index["weight_map"].values())
        (folder.parent / "other_model").mkdir()
        (folder / name).rename(folder.parent / "other_model" / name)
        path = str(folder.parent / "other_model" / name) if absolute else f"../other_model/{name}"
        edit_weight_map(lambda names: {k: path if v == name else v for k, v in names.items()})(folder)

    return damage


def integer_weights(folder: Path) -> None:
    """Damage: the final norm's weights stored as int32 (safetensors keeps the dtype in the header)."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    file = folder / index["weight_map"]["model.norm.weight"]
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, file, metadata={"format": "pt"})


def saved_recipe(edit):
    """Damage: the checkpoint's saved recipe (the TOML in train_state.json) as `edit(the recipe as a dict)` makes
    it (a str: that text), the manifest rewritten to match."""
    import tomli_w

    def damage(folder: Path) -> None:
        def change(state: dict) -> dict:
            recipe = edit(tomllib.loads(state["recipe"]))
            return {**state, "recipe": recipe if isinstance(recipe, str) else tomli_w.dumps(recipe)}

        edit_json("train_state.json", change)(folder)

    return damage


def with_overrides(**values):
    return saved_recipe(lambda r: {**r, "model": {**r["model"], "overrides": {**r["model"]["overrides"], **values}}})


def one_record(**values) -> str:
    return json.dumps({"step": 1, "loss": 2.5, **values}) + "\n"


# hf-tokenizer: an HF folder's tokenizer files, which hf-to-dcp copies (a recipe with a tokenizer of its own
# initialised from the folder reads none of them).
FOLDER_READERS = {"run": ("compare",), "hf": ("hf-to-dcp", "init_from_hf"), "hf-tokenizer": ("hf-to-dcp",),
                  "recipe": ("dcp-to-hf", "generate"), "generate": ("generate",)}  # fmt: skip
HF_INDEX = "model.safetensors.index.json"
# (id, folder, damage(folder) or extra command-line arguments, words)
FOLDERS = [
    ("step time of text at step 10^6", "run", file_text("metrics.jsonl", one_record(step=10**6, step_time_s="x")),
     ["metrics.jsonl line 1: step_time_s must be a finite number >= 0, got 'x'"]),
    ("elapsed time of text", "run", file_text("metrics.jsonl", one_record(elapsed_s="x")),
     ["metrics.jsonl line 1: elapsed_s must be a finite number >= 0, got 'x'"]),
    ("elapsed time NaN", "run", file_text("metrics.jsonl", one_record(elapsed_s=math.nan)),
     ["metrics.jsonl line 1: elapsed_s must be a finite number >= 0, got nan"]),
    ("step of 5000 digits", "run", file_text("metrics.jsonl", '{"step": 1' + "0" * 5000 + ', "loss": 1.0}\n'),
     ["metrics.jsonl line 1 is not valid JSON"]),
    ("layout of an unknown degree", "run", edit_file("run_info.json", lambda info: {**info, "layout": {"xp": 2}}),
     ["run_info.json: layout has 'xp', which is none of dp_replicate"]),
    ("recipe of tracking.json a number", "run", edit_file("tracking.json", lambda t: {**t, "recipe": 5}),
     ["tracking.json: recipe must be a string, got 5"]),
    ("config.toml of arrays nested deep", "run", file_text("config.toml", "a = " + "[" * 5000 + "]" * 5000 + "\n"),
     ["config.toml is not valid TOML", "nests tables or arrays more than 32 deep"]),
    ("config.toml of tables nested deep", "run", file_text("config.toml", f"[{'.'.join(['a'] * 2000)}]\nx = 1\n"),
     ["config.toml is not valid TOML", "nests tables or arrays more than 32 deep"]),
    ("index naming a file outside", "hf", moved_out(absolute=False),
     [f"{HF_INDEX}: weight_map[", "must be a file name in its folder", "got '../other_model/"]),
    ("index naming an absolute path", "hf", moved_out(absolute=True),
     [f"{HF_INDEX}: weight_map[", "must be a file name in its folder", "got '/"]),
    ("index of a list", "hf", edit_weight_map(lambda names: list(names.values())),
     [f"{HF_INDEX}: weight_map must be a non-empty object, got ['model-"]),
    ("rms_norm_eps NaN", "hf", edit_file("config.json", lambda c: {**c, "rms_norm_eps": math.nan}),
     ["config.json: rms_norm_eps must be a finite number > 0, got nan"]),
    ("10^12 positions", "hf", edit_file("config.json", lambda c: {**c, "max_position_embeddings": 10**12}),
     ["config.json: max_position_embeddings must be an integer in [1, 2^24], got 1000000000000"]),
    ("hidden size infinite", "hf", edit_file("config.json", lambda c: {**c, "hidden_size": math.inf}),
     ["config.json: hidden_size must be an integer in [1, 2^17], got inf"]),
    ("rope_theta infinite", "hf", edit_file("config.json", lambda c: {**c, "rope_theta": math.inf,
     "rope_parameters": {**c["rope_parameters"], "rope_theta": math.inf}}),
     ["config.json: rope_", "rope_theta must be a finite number > 0, got inf"]),
    ("generation config linking out", "hf-tokenizer", linked_out("generation_config.json", Path("/proc/self/environ")),
     ["generation_config.json leads outside its folder (to /proc/", "titan reads only the folder's own files"]),
    ("weights file linking out", "hf", linked_out("model.safetensors.index.json", None),
     ["model.safetensors.index.json leads outside its folder", "replace the link with the file itself"]),
    ("tokenizer config not JSON", "hf-tokenizer", file_text("tokenizer_config.json", "{not json"),
     ["tokenizer_config.json is not readable JSON", "the folder's tokenizer is damaged"]),
    ("integer weights", "hf", integer_weights, ["tensor model.norm.weight is I32", "F32, BF16"]),
    ("saved overrides of text", "recipe", saved_recipe(lambda r: {**r, "model": {**r["model"], "overrides": "big"}}),
     ["corrupt", "the recipe in train_state.json: model.overrides must be a table, got 'big'"]),
    ("saved tokenizer path a number", "recipe", saved_recipe(lambda r: {**r, "tokenizer": {"path": 5}}),
     ["corrupt", "the recipe in train_state.json: tokenizer.path must be str, got 5"]),
    ("saved norm_eps NaN", "recipe", with_overrides(norm_eps=math.nan),
     ["its recipe's model is invalid: norm_eps must be a finite number > 0, got nan"]),
    ("saved max_seq_len 10^12", "recipe", with_overrides(max_seq_len=10**12),
     ["its recipe's model is invalid: max_seq_len must be at most 16,777,216, got 1,000,000,000,000"]),
    ("saved recipe nested too deep", "recipe", saved_recipe(lambda _: "a = " + "[" * 5000 + "]" * 5000 + "\n"),
     ["corrupt", "the recipe in train_state.json: nests tables or arrays more than 32 deep"]),
    ("temperature NaN", "generate", ["--temperature", "nan"], ["--temperature must be a finite number >= 0", "nan"]),
    ("temperature infinite", "generate", ["--temperature", "inf"], ["--temperature must be a finite number", "inf"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, saved) -> Path:
    """The saved checkpoint as an HF folder of several weights files and their index."""
    from titan.checkpoint.hf import dcp_to_hf

    folder = tmp_path_factory.mktemp("hf") / "model"
    dcp_to_hf(saved, folder, max_shard_size="200KB")
    assert (folder / HF_INDEX).is_file()
    return folder


def folder_run(case, command: str, tmp: Path, saved: Path, hf: Path) -> tuple[list[str], dict]:
    """The CLI run of `command` on the case's crafted copy of its folder, in a folder of its own."""
    _, kind, damage, _ = case
    tmp.mkdir(parents=True)
    source = {"run": saved.parent.parent, "hf": hf, "hf-tokenizer": hf}.get(kind, saved)
    folder = tmp / source.name
    shutil.copytree(source, folder)
    extra = damage if isinstance(damage, list) else []
    if callable(damage):
        damage(folder)
    if command == "compare":
        return ["compare", str(folder)], {}
    if command == "hf-to-dcp":
        return ["convert", "hf-to-dcp", str(folder), str(tmp / "out")], {}
    if command == "init_from_hf":
        overrides = tiny_overrides(tmp, **{**SMALL, **SAVED, "checkpoint.init_from_hf": str(folder)})
        return ["train", "--config", str(DEBUG_RECIPE), *overrides], {}
    if command == "dcp-to-hf":
        return ["convert", "dcp-to-hf", str(folder), str(tmp / "out")], {}
    return ["generate", "--checkpoint", str(folder), "--prompt", "Once upon a time", *extra], {}


@pytest.fixture(scope="module")
def folder_results(tmp_path_factory, saved, hf_folder) -> dict:
    root = tmp_path_factory.mktemp("folders")
    keys = [(i, command) for i, case in enumerate(FOLDERS) for command in FOLDER_READERS[case[1]]]
    runs = [folder_run(FOLDERS[i], command, root / f"case{i}-{command}", saved, hf_folder) for i, command in keys]
    return dict(zip(keys, run_titan_many(runs)))


@pytest.mark.parametrize("index", range(len(FOLDERS)), ids=[c[0] for c in FOLDERS])
def test_a_crafted_folder_is_one_line_naming_the_file_and_field(folder_results, index):
    _, kind, _, words = FOLDERS[index]
    for command in FOLDER_READERS[kind]:
        assert_one_line_error(folder_results[(index, command)], *words)


def test_the_folders_table_covers_every_reader():
    assert {c[1] for c in FOLDERS} == set(FOLDER_READERS) and len({c[0] for c in FOLDERS}) == len(FOLDERS) >= 20
