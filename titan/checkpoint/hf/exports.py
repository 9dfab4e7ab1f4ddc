"""A titan checkpoint's model out: its model and tokenizer as the recipe saved them (open_model_checkpoint,
checkpoint_tokenizer, load_tensors: dcp-to-hf and titan generate read them), and `titan convert dcp-to-hf`."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from titan import models
from titan.checkpoint.format import CheckpointReader, dcp_error, single_process_quiet, verify
from titan.checkpoint.hf.card import model_card
from titan.checkpoint.hf.files import (
    CONFIG_FILE,
    INDEX_FILE,
    TOKENIZER_FILES,
    atomic_folder,
    hf_shapes,
    hf_spec,
    stacked,
)
from titan.checkpoint.hf.memory import PeakMemory, release_freed_memory
from titan.checkpoint.resume import find_checkpoint
from titan.checkpoint.train_state import buffer_shapes, model_shapes, read_train_state
from titan.config import saved_section
from titan.dtypes import TORCH_NAMES, parse_dtype
from titan.errors import ConfigError
from titan.progress import Progress

DEFAULT_MAX_SHARD_SIZE = "2GB"
CARD_FILE = "README.md"  # the model card, as the hub shows it
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelCheckpoint:
    """A titan checkpoint's model as its recipe and DCP index describe it, checked against each other (no tensor
    is read)."""

    path: Path  # the step-N folder
    spec: models.ModelSpec
    args: Any
    saved: dict[str, tuple[list[int], torch.dtype]]  # parameter or buffer (model_buffers) -> (shape, dtype as saved)


def open_model_checkpoint(path: Path, rank: int = 0, world: int = 1, group=None) -> ModelCheckpoint:
    """The model of the titan checkpoint at `path` (a step-N folder, or a checkpoints/ or run folder: its newest),
    after verifying the folder's files: with several ranks (and `group`) each hashes its share."""
    path = find_checkpoint(path)
    problem = verify(path, rank, world, group)
    if problem:
        raise ConfigError(f"checkpoint {problem}; use another checkpoint")
    model = _saved_section(path, "model")
    saved_tokenizer(path)  # read after the weights, checked before them
    spec = hf_spec(model.name)
    try:
        # The flavor's own max_seq_len (or the recipe's override), not training.seq_len: the model's context length.
        args = models.model_args(model.name, model.flavor, model.overrides)
        args.validate()
    except ValueError as e:
        raise ConfigError(f"checkpoint {path}: its recipe's model is invalid: {e}") from None
    metadata = CheckpointReader(path).read_metadata().state_dict_metadata
    saved, buffers = {}, buffer_shapes(spec, args)
    for name, shape in {**model_shapes(spec, args), **buffers}.items():
        entry = metadata.get(f"model.{name}")
        if entry is None or list(getattr(entry, "size", [])) != shape:
            found = "absent" if entry is None else f"of shape {list(entry.size)}"
            raise ConfigError(
                f"checkpoint {path}: {'buffer' if name in buffers else 'parameter'} {name} is {found}, but its "
                f"recipe's model has shape {shape}"
            )
        saved[name] = (shape, entry.properties.dtype)
    return ModelCheckpoint(path, spec, args, saved)


def _saved_section(path: Path, name: str):
    """A section of the recipe saved in the checkpoint at `path`, typed (config.saved_section)."""
    try:
        return saved_section(read_train_state(path)["recipe"], name)
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} is corrupt: the recipe in train_state.json: {e}") from None


def saved_tokenizer(path: Path):
    """The [tokenizer] of the recipe saved in the checkpoint at `path` (a step-N folder), naming the copy its run
    folder holds where it has one: the file the run trained with, wherever the folder went since."""
    cfg = _saved_section(path, "tokenizer")
    copy = Path(path).parent.parent / "tokenizer" / "tokenizer.json"
    return replace(cfg, path=str(copy)) if copy.is_file() else cfg


@torch.no_grad()
def load_tensors(path: Path, tensors: dict[str, Tensor]) -> None:
    """Fill `tensors` ({parameter: tensor}) from the checkpoint at `path`: plain tensors whole, DTensors their local
    shard, each cast to its tensor's dtype and copied to its device. DCP reads only the saved chunks that overlap
    them, one at a time, whatever layout wrote them: the host holds one saved chunk at most besides."""
    try:
        with single_process_quiet():
            dcp.load({"model": tensors}, storage_reader=CheckpointReader(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # assorted errors on truncated or foreign files
        raise ConfigError(f"checkpoint {path} is corrupt or incomplete: {dcp_error(e)}") from None


def load_parameters(path: Path, saved: dict[str, tuple[list[int], torch.dtype]]) -> dict[str, Tensor]:
    """The whole tensors `saved` names ({name: (shape, dtype)}), as saved."""
    # Zeros, not empty: were an element ever left unread, the export would hold no stale process memory.
    tensors = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in saved.items()}
    load_tensors(path, tensors)
    return tensors


def parse_size(text: str | int) -> int:
    """Bytes in '2GB', '500MB', '1.5GiB', '10KB' or a plain number (decimal units, as transformers reads them)."""
    scales = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Z]*)", str(text).strip().upper())
    if not match or match.group(2) not in scales:
        raise ConfigError(f"--max-shard-size {text!r}: expected a size like 2GB, 500MB, 1GiB or a number of bytes")
    size = int(float(match.group(1)) * scales[match.group(2)])
    if size <= 0:
        raise ConfigError(f"--max-shard-size {text!r} must be positive")
    return size


def checkpoint_tokenizer(path: Path, vocab_size: int, override: Path | None = None):
    """The tokenizer a checkpoint's recipe names (or the tokenizer.json `override`, with the recipe's BOS/EOS), as
    titan.data.Tokenizer; ConfigError when it cannot be read or has more tokens than the model."""
    from titan.data.tokenizer import Tokenizer

    cfg = saved_tokenizer(path)
    if override is not None:
        cfg = replace(cfg, path=str(override))
    elif not cfg.path:  # converted from an HF folder without a tokenizer.json
        raise ConfigError(f"checkpoint {path}'s recipe names no tokenizer: pass --tokenizer (its tokenizer.json)")
    try:
        tokenizer = Tokenizer(cfg)
    except ConfigError as e:
        where = "--tokenizer" if override is not None else f"checkpoint {path}'s recipe (or pass --tokenizer)"
        raise ConfigError(f"{where}: {e}") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model only {vocab_size}: "
            "not the tokenizer it was trained with"
        )
    return tokenizer


def write_tokenizer_files(folder: Path, tokenizer, max_len: int) -> None:
    """TOKENIZER_FILES for transformers' AutoTokenizer and generate, from titan's tokenizer.

    titan trains on documents framed BOS + text + EOS and continues a prompt as BOS + text; so the tokenizer.json
    written prepends BOS to what it encodes (a post-processor, as Llama 3's own tokenizer.json has), unless the
    source tokenizer does so already, or has no BOS (Qwen's: text + EOS, and a prompt is its text). Decoding keeps
    the text as titan decodes it (no clean-up of spaces).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    hf = HFTokenizer.from_file(str(tokenizer.path))
    bos = None if tokenizer.bos_id is None else hf.id_to_token(tokenizer.bos_id)
    eos = hf.id_to_token(tokenizer.eos_id)
    if bos is not None and hf.encode("a").ids[:1] != [tokenizer.bos_id]:
        prepend = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)]
        )
        hf.post_processor = prepend if hf.post_processor is None else processors.Sequence([hf.post_processor, prepend])
    hf.save(str(folder / "tokenizer.json"))
    # Pad with EOS, as Llama 3's exports do: titan's tokenizers have no pad token, and a new one would be an id
    # the embedding never trained. Padded positions are masked (attention_mask 0), so which id fills them does
    # not change a prompt's tokens; transformers' batched tokenization (padding=True) needs one set.
    special = {**({"bos_token": bos} if bos else {}), "eos_token": eos, "pad_token": eos}
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",  # the tokenizer.json as it is, as Llama 3 ships it
            **special,
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
        },
        "special_tokens_map.json": special,
        # Greedy, as `titan generate` by default; batches pad with EOS (the tokenizer's pad token).
        "generation_config.json": {
            **({"bos_token_id": tokenizer.bos_id} if bos else {}),
            "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.eos_id,
        },
    }
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")


def dcp_to_hf(
    checkpoint: Path,
    out_dir: Path,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    dtype: str = "float32",
    tokenizer: Path | None = None,
    name: str | None = None,
) -> str:
    """Export the model of a titan checkpoint, and the tokenizer its recipe names (or `tokenizer`), as an HF folder
    with a model card (README.md, whose loading example names `name`: the hub repository, by default the folder),
    one weights file in memory at a time; returns the report to print."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    dtype = TORCH_NAMES[parse_dtype(dtype, TORCH_NAMES)]  # torch's name, as HF's config.json has it
    max_bytes, out_dtype = parse_size(max_shard_size), _DTYPES[dtype]
    with PeakMemory() as peak:
        found = open_model_checkpoint(checkpoint)
        path, spec, args = found.path, found.spec, found.args
        config = _hf_config(found, dtype)
        tok, tokenizer_note = _export_tokenizer(path, args.vocab_size, tokenizer)
        sources = spec.hf.sources(args)
        saved = {name: found.saved[name] for name in sources}  # the parameters, and the buffers the format holds
        buffers = set(sources) - set(model_shapes(spec, args))
        copies = spec.hf.export_copies(args) if spec.hf.export_copies else {}
        owners = {hf: titan for titan in saved for hf in stacked(sources[titan][0])}  # a stack's tensors: its own
        owners |= {copy: owners[original] for copy, original in copies.items()}
        # huggingface_hub plans the files and the index from sizes alone (meta tensors: nothing is allocated). Its
        # save_torch_state_dict would need every tensor in memory at once, so the files are written here, one
        # at a time.
        planned = {
            hf: torch.empty(shape, dtype=out_dtype, device="meta")
            for titan, (titan_shape, _) in saved.items()
            for hf, shape in hf_shapes(sources[titan][0], titan_shape).items()
        }
        planned |= {copy: planned[original] for copy, original in copies.items()}
        split = split_torch_state_dict_into_shards(planned, max_shard_size=max_bytes)
        n_params = sum(math.prod(shape) for shape, _ in saved.values())
        what = f"exporting {path.name} to {Path(out_dir).name}"
        with atomic_folder(Path(out_dir)) as tmp, Progress(what, split.metadata["total_size"], "B") as progress:
            if tok is not None:
                config.update(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)  # a bos_token_id of None: none
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            for file, hf_names in split.filename_to_tensors.items():
                tensors = load_parameters(path, {owners[hf]: saved[owners[hf]] for hf in hf_names})
                weights = _hf_tensors(spec, sources, tensors, set(hf_names), out_dtype, buffers, copies)
                save_file(weights, str(tmp / file), metadata={"format": "pt"})
                progress.update(sum(w.numel() * w.element_size() for w in weights.values()))
                del weights  # before the next file's tensors are loaded, not after
                release_freed_memory()
            if split.is_sharded:
                index = {
                    "metadata": {**split.metadata, "total_parameters": n_params},
                    "weight_map": split.tensor_to_filename,
                }
                (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            if tok is not None:
                write_tokenizer_files(tmp, tok, args.max_seq_len)
            (tmp / CARD_FILE).write_text(model_card(found, n_params, tok, dtype, name or str(out_dir)))
    files = len(split.filename_to_tensors)
    return (
        f"wrote {out_dir}: {CARD_FILE}, {CONFIG_FILE}, {files} safetensors file{'s' * (files > 1)}"
        f"{' with ' + INDEX_FILE if split.is_sharded else ''} ({len(planned)} tensors, {n_params / 1e6:.2f}M "
        f"parameters, {dtype}) from {path}, one file in memory at a time (peak host memory added: {peak}), and "
        f"{tokenizer_note}"
    )


def _hf_config(found: ModelCheckpoint, dtype: str) -> dict[str, Any]:
    """The config.json of the checkpoint's model; ConfigError when the HF model cannot express it: its args, or
    the values of its buffers (the adapter's check_buffers), which are read here."""
    spec, args = found.spec, found.args
    try:
        config = spec.hf.config_from_args(args, dtype)
        sources = spec.hf.sources(args)
        buffers = [name for name in buffer_shapes(spec, args) if name not in sources]
        if buffers:
            spec.hf.check_buffers(args, load_parameters(found.path, {name: found.saved[name] for name in buffers}))
    except ValueError as e:
        raise ConfigError(f"cannot export checkpoint {found.path} to Hugging Face: {e}") from None
    return config


def _hf_tensors(
    spec, sources: dict, tensors: dict[str, Tensor], hf_names: set[str], dtype, buffers: set[str], copies: dict
) -> dict[str, Tensor]:
    """The HF tensors `hf_names`, in `dtype`, from the titan parameters holding them (taken out of `tensors`): a
    stacked one gives each of its HF tensors that is in `hf_names` (a stack may span files), and a tensor the copies
    of it that are (`copies`: {copy: original}). Buffers (routing biases) stay float32, as transformers keeps them:
    rounded, they would route tokens otherwise."""
    copied: dict[str, list[str]] = {}
    for copy, original in copies.items():
        copied.setdefault(original, []).append(copy)
    weights = {}
    for titan in list(tensors):
        hf_name, rows = sources[titan]
        w = tensors.pop(titan)
        as_saved = torch.float32 if titan in buffers else dtype
        parts = [w] if isinstance(hf_name, str) else w.unbind(0)
        for name, part in zip(stacked(hf_name), parts):
            outs = [n for n in (name, *copied.get(name, ())) if n in hf_names]
            for i, out in enumerate(outs):
                # Each its own memory: safetensors refuses tensors that share it (a stack's parts, a copy).
                shared = i > 0 or not isinstance(hf_name, str)
                weights[out] = spec.hf.to_hf_tensor(part, rows).to(as_saved, copy=shared).contiguous()
    return weights


def _export_tokenizer(path: Path, vocab_size: int, override: Path | None):
    """(the tokenizer to export with checkpoint `path`, or None; what the report says of it). A recipe's
    tokenizer that is not here (or none: a checkpoint converted from an HF folder without one) leaves the export
    without tokenizer files, which the report says; a --tokenizer that fails is an error."""
    try:
        tok = checkpoint_tokenizer(path, vocab_size, override)
    except ConfigError as e:
        if override is not None:
            raise ConfigError(f"--tokenizer: {e}") from None
        return None, f"no tokenizer files ({e}; pass --tokenizer PATH/tokenizer.json)"
    return tok, f"the tokenizer files ({', '.join(TOKENIZER_FILES)}) from {tok.path}"
