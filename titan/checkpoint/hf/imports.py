"""Hugging Face checkpoints into titan: `titan convert hf-to-dcp` writes a titan checkpoint folder holding the model,
and `checkpoint.init_from_hf` loads an HF folder straight into the trainer's (sharded) model."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from titan import models
from titan.checkpoint.format import CheckpointWriter, dcp_error, seal, single_process_quiet
from titan.checkpoint.hf.files import (
    TOKENIZER_FILES,
    atomic_folder,
    copy_tokenizer_files,
    held_shapes,
    hf_spec,
    hf_tokenizer,
    open_hf,
    read_hf_config,
    read_into,
)
from titan.checkpoint.hf.match import check_model_matches, describe_match, model_toml
from titan.checkpoint.hf.memory import PeakMemory
from titan.checkpoint.train_state import buffer_shapes, model_shapes, write_train_state
from titan.config import Config, Model, Tokenizer, to_toml, toml_value
from titan.errors import ConfigError
from titan.hub import model_folder

log = logging.getLogger("titan")


# ---------------------------------------------------------------------------------------------------------------
# hf-to-dcp
# ---------------------------------------------------------------------------------------------------------------


def hf_to_dcp(hf_dir: Path, out_dir: Path, model_name: str | None = None, flavor: str | None = None) -> str:
    """Write the HF folder's weights as a titan checkpoint (model only, fp32); returns the report to print.
    model_name None: the family that reads the folder's model_type."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if model_name is None:
        model_type = read_hf_config(hf_dir).get("model_type", "llama")
        try:
            model_name = models.family_of_hf(str(model_type))
        except KeyError as e:
            raise ConfigError(str(e.args[0])) from None
    spec = hf_spec(model_name)
    hf = open_hf(hf_dir, spec)
    sentence, flavor, overrides = describe_match(spec, hf.args, flavor)
    tokenizer = _tokenizer_of(hf_dir, out_dir, hf.args.vocab_size)
    shapes = model_shapes(spec, hf.args)
    # The trainer's parameters are fp32 (mixed precision casts copies), so that is what a checkpoint holds.
    held = held_shapes(spec, hf.args, hf.sources)
    tensors = {name: torch.empty(shape, dtype=torch.float32) for name, shape in held.items()}
    read_into(hf, tensors.items(), f"reading {hf_dir.name}")
    # The state besides the parameters that the format has no place for (Qwen3-MoE's routing biases): the HF model
    # is the one with it at zero, which is what the export requires of it (the adapter's check_buffers).
    tensors.update(
        {name: torch.zeros(shape) for name, shape in buffer_shapes(spec, hf.args).items() if name not in held}
    )
    recipe = Config(model=Model(name=spec.name, flavor=flavor, overrides=overrides), tokenizer=tokenizer)
    with atomic_folder(out_dir) as tmp:
        copied = copy_tokenizer_files(hf_dir, tmp) if tokenizer.path else []  # sealed with the weights
        try:
            writer = CheckpointWriter(tmp, progress=f"writing {out_dir.name}")
            with single_process_quiet():
                dcp.save({"model": tensors}, storage_writer=writer, no_dist=True)
        except CheckpointException as e:  # DCP wraps the writer's error (a full disk) with every rank's traceback
            raise ConfigError(f"cannot write {out_dir}: {dcp_error(e)}") from None
        # Weights only: no optimizer, scheduler or data state (parts), and where they came from (source).
        write_train_state(
            tmp,
            step=0,
            tokens_seen=0,
            lr_scheduler={},
            recipe=to_toml(recipe),
            model={"name": spec.name, "flavor": flavor, "shapes": shapes},
            parts=["model"],
            source={"hf_checkpoint": str(hf_dir.resolve())},
        )
        seal(tmp)
    n_params = sum(math.prod(s) for s in shapes.values())
    return "\n".join(
        [
            f"wrote {out_dir}: a titan checkpoint (model weights only, float32) of the {spec.name} model in {hf_dir} "
            f"({len(tensors)} tensors, {n_params / 1e6:.2f}M parameters, {hf.dtypes} in the HF files)",
            f"{sentence}; its tokenizer: {_copied(copied, hf_dir)}. Start a run from it with, in the recipe:",
            "",
            model_toml(spec.name, flavor, overrides),
            "",
            *([_tokenizer_toml(tokenizer), ""] if copied else []),
            "[checkpoint]",
            f"resume = {toml_value(str(out_dir))}",
            'load_only = ["model"]',
            "",
            "(checkpoint.resume names this folder on every start: once the run has checkpoints of its own, set it back "
            f'to "auto"; or use checkpoint.init_from_hf = {toml_value(str(hf_dir))}, which only applies to a fresh '
            "start.)",
        ]
    )


def _tokenizer_of(hf_dir: Path, out_dir: Path, vocab_size: int) -> Tokenizer:
    """The [tokenizer] of the checkpoint hf-to-dcp writes to `out_dir`: the HF folder's tokenizer, read from its
    copy there (an absolute path: the recipe is read from any folder); none when the folder has no tokenizer.json.
    ConfigError when it does not fit the model's `vocab_size` embedding rows."""
    from titan.data.tokenizer import Tokenizer as TitanTokenizer

    found = hf_tokenizer(hf_dir)
    if found is None:
        return Tokenizer()
    tokenizer = TitanTokenizer(found)  # its BOS and EOS are in the vocabulary
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"{hf_dir}: its tokenizer.json has {tokenizer.vocab_size} tokens but the model's embedding only "
            f"{vocab_size} rows: not this model's tokenizer"
        )
    return replace(found, path=str(out_dir.resolve() / TOKENIZER_FILES[0]))


def _copied(names: list[str], hf_dir: Path) -> str:
    return f"{', '.join(names)}, copied beside the weights" if names else f"none ({hf_dir} has no tokenizer.json)"


def _tokenizer_toml(tokenizer: Tokenizer) -> str:
    return "\n".join(["[tokenizer]", *(f"{key} = {toml_value(value)}" for key, value in asdict(tokenizer).items())])


# ---------------------------------------------------------------------------------------------------------------
# checkpoint.init_from_hf
# ---------------------------------------------------------------------------------------------------------------


def init_from_hf(named_tensors, spec: models.ModelSpec, model_args, source: str | Path, recipe_model: str) -> None:
    """Load the HF folder `source` into these parameters and buffers (this rank's, of any layout), after checking
    that it holds the model `model_args` describe (`recipe_model` names it in errors, e.g. "llama3 debug"). Buffers
    the files have no place for are left as they are. Each rank reads only the parts of the files its shards
    hold."""
    source = model_folder(str(source), "checkpoint.init_from_hf")
    spec = hf_spec(spec.name)
    with PeakMemory() as peak:
        try:
            hf = open_hf(source, spec)
        except ConfigError as e:
            raise ConfigError(f"checkpoint.init_from_hf: {e}") from None
        check_model_matches(spec, model_args, hf.args, f"checkpoint.init_from_hf {source}", recipe_model)
        try:
            held = [(name, tensor) for name, tensor in named_tensors if name in hf.sources]
            count, read = read_into(hf, held, f"checkpoint.init_from_hf: reading {source.name}")
        except ConfigError as e:
            raise ConfigError(f"checkpoint.init_from_hf: {e}") from None
    n_params = sum(math.prod(s) for s in model_shapes(spec, hf.args).values())
    log.info(
        "initialised the model from HF checkpoint %s: %d parameter tensors on this rank, %.1f MiB read from the "
        "files, peak host memory added %s (model: %.2fM parameters, %s in the files)",
        source,
        count,
        read / 2**20,
        peak,
        n_params / 1e6,
        hf.dtypes,
    )
