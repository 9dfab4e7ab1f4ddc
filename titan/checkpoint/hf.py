"""Hugging Face checkpoints in and out of titan: `titan convert hf-to-dcp | dcp-to-hf`, and `checkpoint.init_from_hf`.

An HF checkpoint is a folder with `config.json` and the weights as `model.safetensors`, or as shards
`model-0000i-of-0000n.safetensors` listed in `model.safetensors.index.json`. Only safetensors are read or
written (no pickle). The model family's `HFAdapter` (titan/models/__init__.py) maps configs and weights tensor
by tensor, including Llama's q/k RoPE rows; this module does the files, the checks and the sharded copies.
Import and export never hold the whole model in one process, so they scale with it: a 70B model is 140 GB of
bf16 files, which read whole by each of a node's 8 ranks would take 1.1 TB; read per rank, 140 GB in all.

* init_from_hf loads an HF folder straight into the trainer's model, sharded or not: the headers are checked
  against config.json and the recipe, then every rank reads, per parameter, one slice of the file (the box around
  the rows and columns its shard holds) and copies its elements out of it.
* hf-to-dcp reads the same way into full fp32 tensors and writes a titan checkpoint folder (the layout of
  titan/checkpoint/format.py) holding only the model: DCP shards with keys `model.<fqn>`, `train_state.json` at
  step 0, and the COMPLETE marker, written under a temporary name and renamed. Train from it with
  `checkpoint.resume = <folder>` and `load_only = ["model"]`. (It holds the model, in one process.)
* dcp-to-hf exports the model part of any titan checkpoint (whatever layout saved it): the output files are
  planned from the checkpoint's metadata (huggingface_hub's shard split), then each is filled by loading just its
  tensors from DCP, written, and freed before the next. `config.json` plus safetensors shards, with an index when
  there are several, and the recipe's tokenizer as transformers' AutoTokenizer and generate read it.
  `titan generate` reads a checkpoint's model alike (open_model_checkpoint, then load_tensors into its own
  parameters, a layer at a time).

init_from_hf and dcp-to-hf report the peak host memory they added (`PeakMemory`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from titan import models
from titan.checkpoint.checkpointer import (
    find_checkpoint,
    model_shapes,
    read_train_state,
    single_process_quiet,
    write_train_state,
)
from titan.checkpoint.format import CheckpointReader, CheckpointWriter, dcp_error, seal, verify
from titan.checkpoint.hf_match import check_model_matches, describe_match, model_toml
from titan.config import Config, Model, saved_section, to_toml, toml_value
from titan.errors import ConfigError
from titan.progress import Progress
from titan.schema import FILE_NAME, MapOf, Table, read_json

log = logging.getLogger("titan")

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "2GB"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# An index names each tensor's file: a plain file name, so that every file read is one of the folder's own.
WEIGHT_INDEX = Table({"weight_map": MapOf(FILE_NAME, filled=True)}, required=frozenset({"weight_map"}))
# The safetensors dtypes of weights titan reads (as floats, cast to the model's dtype); an integer tensor is not one.
FLOAT_WEIGHTS = ("F64", "F32", "BF16", "F16")


# ---------------------------------------------------------------------------------------------------------------
# Peak host memory
# ---------------------------------------------------------------------------------------------------------------


class PeakMemory:
    """`with PeakMemory() as peak: ...`, then `peak.added`: the most resident host memory the block added, in
    bytes, or None where that cannot be measured.

    Linux keeps each process's high-water mark of resident memory (VmHWM in /proc/self/status), and writing "5"
    to /proc/self/clear_refs resets it to the current size (VmRSS): the mark after the block minus VmRSS before it
    is the block's peak. Elsewhere (not Linux, or a /proc that refuses the write) `added` stays None. It counts
    the pages of files mapped in (safetensors maps what it reads), not memory the allocator had kept from before
    and hands out again. A nested measurement resets the mark, hiding an outer block's earlier peak.
    """

    added: int | None = None

    def __enter__(self) -> PeakMemory:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._before = _proc_status_bytes("VmRSS")
        except (OSError, ValueError, KeyError):
            self._before = None
        return self

    def __exit__(self, *exc) -> None:
        if self._before is not None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.added = max(0, _proc_status_bytes("VmHWM") - self._before)

    def __str__(self) -> str:
        return "not measured (needs Linux's /proc)" if self.added is None else f"{self.added / 2**20:.1f} MiB"


def _proc_status_bytes(field: str) -> int:
    """A '<field>:  123 kB' line of /proc/self/status, in bytes."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return 1024 * int(dict(line.split(":", 1) for line in lines)[field].split()[0])


# ---------------------------------------------------------------------------------------------------------------
# Reading an HF folder: its headers first, then tensors a slice at a time
# ---------------------------------------------------------------------------------------------------------------


def hf_spec(model_name: str) -> models.ModelSpec:
    try:
        spec = models.get_model_spec(model_name)
    except KeyError as e:
        raise ConfigError(str(e).strip("'\"")) from None
    if spec.hf is None:
        raise ConfigError(f"model {model_name} has no Hugging Face conversion")
    return spec


def read_hf_config(folder: Path) -> dict[str, Any]:
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"HF checkpoint folder {folder} {what}")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            f"{folder} has no {CONFIG_FILE}: not a Hugging Face model folder (config.json + *.safetensors)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return config


def hf_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder: those its index names, or the single `model.safetensors`."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = read_json(index, WEIGHT_INDEX)["weight_map"]
        except (OSError, ValueError) as e:
            raise ConfigError(f"{folder}: {e}") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} names files that are missing: {', '.join(missing)}")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    hint = (
        (
            f" (it has {', '.join(pickled[:3])}: pickle files, which titan does not read; convert them to safetensors "
            "with transformers' save_pretrained)"
        )
        if pickled
        else ""
    )
    raise ConfigError(f"{folder} has no *.safetensors weights{hint}")


def _read_headers(folder: Path) -> tuple[dict[str, Path], dict[str, list[int]], str]:
    """({HF tensor: its file}, {HF tensor: shape}, the dtypes) from the safetensors headers; no tensor is read."""
    from safetensors import SafetensorError, safe_open

    files: dict[str, Path] = {}
    shapes: dict[str, list[int]] = {}
    dtypes: set[str] = set()
    for file in hf_weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in files:
                        raise ConfigError(f"tensor {name} appears in more than one file of {folder}")
                    part = f.get_slice(name)
                    if part.get_dtype() not in FLOAT_WEIGHTS:
                        raise ConfigError(
                            f"{file}: tensor {name} is {part.get_dtype()}, not weights titan reads "
                            f"({', '.join(FLOAT_WEIGHTS)})"
                        )
                    files[name], shapes[name] = file, list(part.get_shape())
                    dtypes.add(part.get_dtype())
        except SafetensorError as e:
            raise ConfigError(f"{file} is not a valid safetensors file: {e}") from None
    return files, shapes, ", ".join(sorted(dtypes))


@dataclass(frozen=True)
class HFFolder:
    """An HF checkpoint as its config and file headers describe it, checked against each other (`open_hf`);
    its tensors are read later, only the parts a process needs (`read_into`)."""

    path: Path
    args: Any  # the model's args, from config.json
    files: dict[str, Path]  # HF tensor -> the file holding it
    sources: dict[str, tuple[str, Tensor | None]]  # titan parameter -> (HF tensor, rows): the adapter's mapping
    copies: dict[str, str]  # tied copies the files hold -> the HF tensor each must equal
    dtypes: str  # the files' dtypes, for reports


def open_hf(folder: Path, spec: models.ModelSpec) -> HFFolder:
    """The HF folder's config and file headers, checked against each other: ConfigError naming the difference."""
    folder = Path(folder)
    config = read_hf_config(folder)
    try:
        args = spec.hf.args_from_config(config)
    except (ValueError, KeyError, TypeError) as e:
        what = f"lacks {e}" if isinstance(e, KeyError) else str(e)
        raise ConfigError(f"{folder / CONFIG_FILE}: {what}") from None
    files, shapes, dtypes = _read_headers(folder)
    sources = spec.hf.sources(args)
    try:
        copies = spec.hf.check_names(files, args)
        expected = {sources[name][0]: shape for name, shape in model_shapes(spec, args).items()}
        expected.update({copy: expected[original] for copy, original in copies.items()})
        for name, shape in expected.items():
            if shapes[name] != shape:
                raise ValueError(f"{name} has shape {shapes[name]}, but the config makes it {shape}")
    except ValueError as e:
        raise ConfigError(f"{folder}: the weights do not match its {CONFIG_FILE}: {e}") from None
    return HFFolder(folder, args, files, sources, copies, dtypes)


def _shard_index(name: str, param: Tensor) -> tuple[Tensor, list[Tensor]]:
    """(the tensor this process holds of `param`, per dim the global indices of its elements): all of a plain
    tensor; of a DTensor, the local shard, which is the cross product of those index vectors (see ShardIndex)."""
    from torch.distributed.tensor import DTensor

    from titan.rng.shards import ShardIndex

    if not isinstance(param, DTensor):
        return param, [torch.arange(n) for n in param.shape]
    local = param._local_tensor  # to_local() would go through autograd
    coord = param.device_mesh.get_coordinate()
    if coord is None:  # a rank outside the mesh holds nothing
        return local, []
    shard = ShardIndex(param.shape, param.device_mesh.shape, coord, param.placements)
    if tuple(local.shape) != shard.local_shape:
        raise ConfigError(
            f"parameter {name}: cannot copy a {list(shard.local_shape)} part into a {list(local.shape)} shard"
        )
    return local, [torch.arange(n) if v is None else v for n, v in zip(param.shape, shard.vecs)]


def _read_box(file: Path, name: str, index: list[Tensor]) -> tuple[Tensor, int]:
    """(the elements of HF tensor `name` at the cross product of `index`, one vector of indices per dim; bytes read).

    One slice read of their bounding box, then a gather along the dims whose indices are not one ascending run:
    for the common row or column shard (FSDP, TP) the box is the shard itself and nothing is gathered; q/k rows
    reordered within heads gather along rows. Index vectors are per dim, never as large as the shard.
    """
    from safetensors import SafetensorError, safe_open

    starts = [int(v.min()) for v in index]
    try:
        # Opened per read: the tensors safetensors returns map the file, and every page a read touched stays
        # resident while the file is open, which across reads would add up to this process's whole share.
        with safe_open(str(file), framework="pt") as f:
            box = f.get_slice(name)[tuple(slice(s, int(v.max()) + 1) for s, v in zip(starts, index))]
    except SafetensorError as e:
        raise ConfigError(f"{file} is not a valid safetensors file: {e}") from None
    read = box.numel() * box.element_size()
    for dim, (start, v) in enumerate(zip(starts, index)):
        if not torch.equal(v, torch.arange(start, start + len(v))):
            box = box.index_select(dim, v - start)
    return box, read


def read_part(hf: HFFolder, name: str, index: list[Tensor]) -> tuple[Tensor, int]:
    """(the elements of titan parameter `name` at the cross product of `index`, one vector of global indices per
    dim, as the HF files hold them; bytes read). A tied copy in the files is read alike and must be equal."""
    hf_name, rows = hf.sources[name]
    if rows is not None:  # the titan rows wanted, as HF numbers them
        index = [rows[index[0]], *index[1:]]
    values, read = _read_box(hf.files[hf_name], hf_name, index)
    for copy in [c for c, original in hf.copies.items() if original == hf_name]:
        copied, n = _read_box(hf.files[copy], copy, index)
        read += n
        if not torch.equal(copied, values):
            raise ConfigError(f"{hf.path}: {copy} differs from {hf_name}, of which the model makes it a copy")
    return values, read


@torch.no_grad()
def read_into(hf: HFFolder, named_tensors, what: str) -> tuple[int, int]:
    """Fill each (titan name, tensor) with its part of the HF weights, cast to the tensor's dtype: a whole plain
    tensor, or the local shard of a DTensor of any layout, showing progress as `what`. Returns (tensors written,
    bytes read from the files)."""
    named_tensors = list(named_tensors)
    total = sum(param.numel() * param.element_size() for _, param in named_tensors)  # of the whole model
    count = read = 0
    with Progress(what, total, "B") as progress:
        for name, param in named_tensors:
            local, index = _shard_index(name, param)
            if local.numel():
                values, n = read_part(hf, name, index)
                local.copy_(values)
                read += n
            count += 1
            progress.update(param.numel() * param.element_size())
    return count, read


# ---------------------------------------------------------------------------------------------------------------
# Writing folders atomically; DCP in one process
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _atomic_folder(out: Path):
    """Yield a temporary folder beside `out`, renamed to `out` when the block succeeds (as checkpoints are)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output folder {out} already exists and is not empty; remove it or choose another")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty (checked above); rename does not replace a folder everywhere
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# hf-to-dcp
# ---------------------------------------------------------------------------------------------------------------


def hf_to_dcp(hf_dir: Path, out_dir: Path, model_name: str = "llama3", flavor: str | None = None) -> str:
    """Write the HF folder's weights as a titan checkpoint (model only, fp32); returns the report to print."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    spec = hf_spec(model_name)
    hf = open_hf(hf_dir, spec)
    sentence, flavor, overrides = describe_match(spec, hf.args, flavor)
    shapes = model_shapes(spec, hf.args)
    # The trainer's parameters are fp32 (mixed precision casts copies), so that is what a checkpoint holds.
    tensors = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    read_into(hf, tensors.items(), f"reading {hf_dir.name}")
    recipe = Config(model=Model(name=spec.name, flavor=flavor, overrides=overrides))
    with _atomic_folder(out_dir) as tmp:
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
            f"{sentence}. Start a run from it with, in the recipe:",
            "",
            model_toml(spec.name, flavor, overrides),
            "",
            "[checkpoint]",
            f"resume = {toml_value(str(out_dir))}",
            'load_only = ["model"]',
            "",
            "(checkpoint.resume names this folder on every start: once the run has checkpoints of its own, set it back "
            f'to "auto"; or use checkpoint.init_from_hf = {toml_value(str(hf_dir))}, which only applies to a fresh '
            "start.)",
        ]
    )


# ---------------------------------------------------------------------------------------------------------------
# The model of a titan checkpoint (dcp-to-hf, titan generate), and dcp-to-hf
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCheckpoint:
    """A titan checkpoint's model as its recipe and DCP index describe it, checked against each other (no tensor
    is read)."""

    path: Path  # the step-N folder
    spec: models.ModelSpec
    args: Any
    saved: dict[str, tuple[list[int], torch.dtype]]  # parameter -> (shape, dtype as saved)


def open_model_checkpoint(path: Path, rank: int = 0, world: int = 1, group=None) -> ModelCheckpoint:
    """The model of the titan checkpoint at `path` (a step-N folder, or a checkpoints/ or run folder: its newest),
    after verifying the folder's files: with several ranks (and `group`) each hashes its share."""
    path = find_checkpoint(path)
    problem = verify(path, rank, world, group)
    if problem:
        raise ConfigError(f"checkpoint {problem}; use another checkpoint")
    model = _saved_section(path, "model")
    _saved_section(path, "tokenizer")  # read after the weights, checked before them
    spec = hf_spec(model.name)
    try:
        # The flavor's own max_seq_len (or the recipe's override), not training.seq_len: the model's context length.
        args = models.model_args(spec, model.flavor, model.overrides)
        args.validate()
    except ValueError as e:
        raise ConfigError(f"checkpoint {path}: its recipe's model is invalid: {e}") from None
    metadata = CheckpointReader(path).read_metadata().state_dict_metadata
    saved = {}
    for name, shape in model_shapes(spec, args).items():
        entry = metadata.get(f"model.{name}")
        if entry is None or list(getattr(entry, "size", [])) != shape:
            found = "absent" if entry is None else f"of shape {list(entry.size)}"
            raise ConfigError(
                f"checkpoint {path}: parameter {name} is {found}, but its recipe's model has shape {shape}"
            )
        saved[name] = (shape, entry.properties.dtype)
    return ModelCheckpoint(path, spec, args, saved)


def _saved_section(path: Path, name: str):
    """A section of the recipe saved in the checkpoint at `path`, typed (config.saved_section)."""
    try:
        return saved_section(read_train_state(path)["recipe"], name)
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} is corrupt: the recipe in train_state.json: {e}") from None


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


def _load_parameters(path: Path, saved: dict[str, tuple[list[int], torch.dtype]]) -> dict[str, Tensor]:
    """The full parameters `saved` names ({name: (shape, dtype)}), as saved."""
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def checkpoint_tokenizer(path: Path, vocab_size: int, override: Path | None = None):
    """The tokenizer a checkpoint's recipe names (or the tokenizer.json `override`, with the recipe's BOS/EOS), as
    titan.data.Tokenizer; ConfigError when it cannot be read or has more tokens than the model."""
    from titan.data.tokenizer import Tokenizer

    cfg = _saved_section(path, "tokenizer")
    if override is not None:
        cfg = replace(cfg, path=str(override))
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
    source tokenizer does so already. Decoding keeps the text as titan decodes it (no clean-up of spaces).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    hf = HFTokenizer.from_file(str(tokenizer.path))
    bos, eos = hf.id_to_token(tokenizer.bos_id), hf.id_to_token(tokenizer.eos_id)
    if hf.encode("a").ids[:1] != [tokenizer.bos_id]:
        prepend = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)]
        )
        hf.post_processor = prepend if hf.post_processor is None else processors.Sequence([hf.post_processor, prepend])
    hf.save(str(folder / "tokenizer.json"))
    special = {"bos_token": bos, "eos_token": eos}
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",  # the tokenizer.json as it is, as Llama 3 ships it
            **special,
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
        },
        "special_tokens_map.json": special,
        # Greedy, as `titan generate` by default; no pad token of its own: batches pad with EOS.
        "generation_config.json": {
            "bos_token_id": tokenizer.bos_id,
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
) -> str:
    """Export the model of a titan checkpoint, and the tokenizer its recipe names (or `tokenizer`), as an HF folder,
    one weights file in memory at a time; returns the report to print."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    max_bytes, out_dtype = parse_size(max_shard_size), _DTYPES[dtype]
    with PeakMemory() as peak:
        found = open_model_checkpoint(checkpoint)
        path, spec, args, saved = found.path, found.spec, found.args, found.saved
        tok, tokenizer_note = _export_tokenizer(path, args.vocab_size, tokenizer)
        sources = spec.hf.sources(args)
        titan_names = {sources[name][0]: name for name in saved}
        # huggingface_hub plans the files and the index from sizes alone (meta tensors: nothing is allocated). Its
        # save_torch_state_dict would need every tensor in memory at once, so the files are written here, one
        # at a time.
        planned = {
            hf: torch.empty(saved[titan][0], dtype=out_dtype, device="meta") for hf, titan in titan_names.items()
        }
        split = split_torch_state_dict_into_shards(planned, max_shard_size=max_bytes)
        n_params = sum(math.prod(shape) for shape, _ in saved.values())
        what = f"exporting {path.name} to {Path(out_dir).name}"
        with _atomic_folder(Path(out_dir)) as tmp, Progress(what, split.metadata["total_size"], "B") as progress:
            config = spec.hf.config_from_args(args, dtype)
            if tok is not None:
                config.update(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            for file, hf_names in split.filename_to_tensors.items():
                tensors = _load_parameters(path, {titan_names[hf]: saved[titan_names[hf]] for hf in hf_names})
                weights = {}
                for hf in hf_names:
                    titan = titan_names[hf]
                    weights[hf] = spec.hf.to_hf_tensor(tensors.pop(titan), sources[titan][1]).to(out_dtype).contiguous()
                save_file(weights, str(tmp / file), metadata={"format": "pt"})
                progress.update(sum(w.numel() * w.element_size() for w in weights.values()))
                del weights  # before the next file's tensors are loaded, not after
            if split.is_sharded:
                index = {
                    "metadata": {**split.metadata, "total_parameters": n_params},
                    "weight_map": split.tensor_to_filename,
                }
                (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            if tok is not None:
                write_tokenizer_files(tmp, tok, args.max_seq_len)
    files = len(split.filename_to_tensors)
    return (
        f"wrote {out_dir}: {CONFIG_FILE}, {files} safetensors file{'s' * (files > 1)}"
        f"{' with ' + INDEX_FILE if split.is_sharded else ''} ({len(saved)} tensors, {n_params / 1e6:.2f}M "
        f"parameters, {dtype}) from {path}, one file in memory at a time (peak host memory added: {peak}), and "
        f"{tokenizer_note}"
    )


def _export_tokenizer(path: Path, vocab_size: int, override: Path | None):
    """(the tokenizer to export with checkpoint `path`, or None; what the report says of it). A recipe's
    tokenizer that is not here (a checkpoint converted from HF names titan's default) leaves the export without
    tokenizer files, which the report says; a --tokenizer that fails is an error."""
    try:
        tok = checkpoint_tokenizer(path, vocab_size, override)
    except ConfigError as e:
        if override is not None:
            raise ConfigError(f"--tokenizer: {e}") from None
        return None, f"no tokenizer files ({e}; pass --tokenizer PATH/tokenizer.json)"
    return tok, f"the tokenizer files ({', '.join(TOKENIZER_FILES)}) from {tok.path}"


# ---------------------------------------------------------------------------------------------------------------
# checkpoint.init_from_hf
# ---------------------------------------------------------------------------------------------------------------


def init_from_hf(named_parameters, spec: models.ModelSpec, model_args, source: str | Path, recipe_model: str) -> None:
    """Load the HF folder `source` into these parameters (this rank's, of any layout), after checking that
    it holds the model `model_args` describe (`recipe_model` names it in errors, e.g. "llama3 debug").
    Each rank reads only the parts of the files its shards hold."""
    source = Path(source)
    spec = hf_spec(spec.name)
    with PeakMemory() as peak:
        try:
            hf = open_hf(source, spec)
        except ConfigError as e:
            raise ConfigError(f"checkpoint.init_from_hf: {e}") from None
        check_model_matches(spec, model_args, hf.args, f"checkpoint.init_from_hf {source}", recipe_model)
        try:
            count, read = read_into(hf, named_parameters, f"checkpoint.init_from_hf: reading {source.name}")
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
