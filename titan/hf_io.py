"""Hugging Face checkpoints in and out of titan: `titan convert hf-to-dcp | dcp-to-hf`, and `checkpoint.init_from_hf`.

An HF checkpoint is a folder with `config.json` and the weights as `model.safetensors`, or as shards
`model-0000i-of-0000n.safetensors` listed in `model.safetensors.index.json`. Only safetensors are read or
written (no pickle). The model family's `HFAdapter` (titan/models/__init__.py) maps configs and weights, including
Llama's q/k RoPE layout; this module does the files, the checks and the sharded copies.

* hf-to-dcp writes a titan checkpoint folder (the layout of titan/checkpoint.py) holding only the model:
  DCP shards with keys `model.<fqn>`, `train_state.json` at step 0, and the COMPLETE marker, written under a
  temporary name and renamed. Train from it with `checkpoint.resume = <folder>` and `load_only = ["model"]`.
* dcp-to-hf reads the model part of any titan checkpoint (whatever layout saved it) into full tensors in
  one process and writes `config.json` plus safetensors shards (with an index when there are several).
* init_from_hf loads an HF folder straight into the trainer's model, sharded or not: every rank reads the
  full tensors on CPU and copies out the elements of its own shards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import tomllib
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from titan import models
from titan.checkpoint import (
    TrustedReader,
    find_checkpoint,
    model_shapes,
    read_train_state,
    seal,
    verify,
    write_train_state,
)
from titan.config import Config, ConfigError, Model, to_toml, toml_value
from titan.hf_match import check_model_matches, describe_match, model_toml

log = logging.getLogger("titan")

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "2GB"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------------------------
# Reading an HF folder
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
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index (needs a weight_map): {e}") from None
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


def read_hf_weights(folder: Path) -> dict[str, Tensor]:
    """Every tensor of an HF folder, as stored (dtype included), on CPU."""
    from safetensors import SafetensorError, safe_open

    weights: dict[str, Tensor] = {}
    for file in hf_weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in weights:
                        raise ConfigError(f"tensor {name} appears in more than one file of {folder}")
                    weights[name] = f.get_tensor(name)
        except SafetensorError as e:
            raise ConfigError(f"{file} is not a valid safetensors file: {e}") from None
    return weights


def load_hf(folder: Path, spec: models.ModelSpec) -> tuple[Any, dict[str, Tensor], str]:
    """(model args, titan state dict of full tensors, the files' dtypes) for an HF folder."""
    folder = Path(folder)
    config = read_hf_config(folder)
    try:
        args = spec.hf.args_from_config(config)
    except (ValueError, KeyError, TypeError) as e:
        what = f"lacks {e}" if isinstance(e, KeyError) else str(e)
        raise ConfigError(f"{folder / CONFIG_FILE}: {what}") from None
    weights = read_hf_weights(folder)
    dtypes = ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()}))
    try:
        state = spec.hf.from_state_dict(weights, args)
    except ValueError as e:
        raise ConfigError(f"{folder}: the weights do not match its {CONFIG_FILE}: {e}") from None
    return args, state, dtypes


# ---------------------------------------------------------------------------------------------------------------
# Writing folders atomically; DCP in one process
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _single_process():
    """DCP warns that it assumes a single process when torch.distributed is not initialised: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


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
    args, state, file_dtype = load_hf(hf_dir, spec)
    sentence, flavor, overrides = describe_match(spec, args, flavor)
    shapes = model_shapes(spec, args)
    # The trainer's parameters are fp32 (mixed precision casts copies), so that is what a checkpoint holds.
    tensors = {name: state[name].to(torch.float32).contiguous() for name in shapes}
    recipe = Config(model=Model(name=spec.name, flavor=flavor, overrides=overrides))
    with _atomic_folder(out_dir) as tmp:
        with _single_process():
            dcp.save({"model": tensors}, checkpoint_id=str(tmp), no_dist=True)
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
            f"({len(tensors)} tensors, {n_params / 1e6:.2f}M parameters, {file_dtype} in the HF files)",
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
# dcp-to-hf
# ---------------------------------------------------------------------------------------------------------------


def read_model_checkpoint(path: Path) -> tuple[Path, models.ModelSpec, Any, dict[str, Tensor]]:
    """(checkpoint folder, spec, model args, full parameters by name) of a titan checkpoint, in one process."""
    path = find_checkpoint(path)
    problem = verify(path)
    if problem:
        raise ConfigError(f"checkpoint {problem}; convert another checkpoint")
    train_state = read_train_state(path)
    try:
        model = tomllib.loads(train_state["recipe"])["model"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"checkpoint {path} is corrupt: cannot read the recipe in train_state.json ({e})") from None
    spec = hf_spec(model.get("name", "llama3"))
    try:
        # The flavor's own max_seq_len (or the recipe's override), not training.seq_len: the model's context length.
        args = models.model_args(spec, model.get("flavor", "debug"), model.get("overrides", {}))
    except ValueError as e:
        raise ConfigError(f"checkpoint {path}: its recipe's model is invalid: {e}") from None
    shapes = model_shapes(spec, args)
    try:
        metadata = TrustedReader(str(path)).read_metadata().state_dict_metadata
    except ConfigError:
        raise
    except Exception as e:  # DCP raises assorted errors on truncated or foreign files
        raise ConfigError(
            f"checkpoint {path} is corrupt: cannot read its DCP metadata ({str(e).strip()[:200]})"
        ) from None
    tensors = {}
    for name, shape in shapes.items():
        saved = metadata.get(f"model.{name}")
        if saved is None or list(getattr(saved, "size", [])) != shape:
            found = "absent" if saved is None else f"of shape {list(saved.size)}"
            raise ConfigError(
                f"checkpoint {path}: parameter {name} is {found}, but its recipe's model has shape {shape}"
            )
        tensors[name] = torch.empty(shape, dtype=saved.properties.dtype)
    try:
        with _single_process():
            dcp.load({"model": tensors}, storage_reader=TrustedReader(str(path)), no_dist=True)
    except Exception as e:
        raise ConfigError(
            f"checkpoint {path} is corrupt or incomplete: {str(e).strip().splitlines()[0][:300]}"
        ) from None
    return path, spec, args, tensors


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


def shard_weights(weights: dict[str, Tensor], max_bytes: int) -> list[dict[str, Tensor]]:
    """Consecutive groups of at most max_bytes (a larger tensor gets a shard of its own), in order."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        n = tensor.numel() * tensor.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += n
    return shards


def write_hf_folder(folder: Path, config: dict, weights: dict[str, Tensor], max_bytes: int) -> list[str]:
    """config.json and the weights as `model.safetensors`, or as shards with an index; returns the file names."""
    from safetensors.torch import save_file

    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    shards = shard_weights(weights, max_bytes)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file({k: v.contiguous() for k, v in shard.items()}, str(folder / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {
                "total_size": sum(t.numel() * t.element_size() for t in weights.values()),
                "total_parameters": sum(t.numel() for t in weights.values()),
            },
            "weight_map": {k: name for name, shard in zip(names, shards) for k in shard},
        }
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        names.append(INDEX_FILE)
    return names


def dcp_to_hf(
    checkpoint: Path, out_dir: Path, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, dtype: str = "float32"
) -> str:
    """Export the model of a titan checkpoint as an HF folder; returns the report to print."""
    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    path, spec, args, tensors = read_model_checkpoint(checkpoint)
    try:
        weights = spec.hf.to_state_dict(tensors, args)
    except ValueError as e:
        raise ConfigError(f"checkpoint {path}: {e}") from None
    weights = {k: v.to(_DTYPES[dtype]) for k, v in weights.items()}
    with _atomic_folder(Path(out_dir)) as tmp:
        files = write_hf_folder(tmp, spec.hf.config_from_args(args, dtype), weights, max_bytes)
    n_params = sum(t.numel() for t in weights.values())
    shards = [f for f in files if f.endswith(".safetensors")]
    return (
        f"wrote {out_dir}: {CONFIG_FILE} and {len(shards)} safetensors file{'s' * (len(shards) > 1)}"
        f"{' with ' + INDEX_FILE if len(shards) > 1 else ''} ({len(weights)} tensors, {n_params / 1e6:.2f}M "
        "parameters, "
        f"{dtype}) from {path}; no tokenizer files are written: copy them from the tokenizer the run used"
    )


# ---------------------------------------------------------------------------------------------------------------
# checkpoint.init_from_hf
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def copy_into_parameters(named_parameters, state: dict[str, Tensor]) -> int:
    """Copy full tensors into parameters by name: DTensors get the elements at their shard's global indices,
    plain tensors the whole tensor. Returns how many parameters were written."""
    from torch.distributed.tensor import DTensor

    from titan.parallel.rng import dtensor_global_indices

    count = 0
    for name, param in named_parameters:
        full = state[name]
        if isinstance(param, DTensor):
            local = param._local_tensor  # to_local() would go through autograd
            if local.numel():
                index = dtensor_global_indices(param, device="cpu")
                values = full.reshape(-1)[index]
            else:
                values = full.new_empty(local.shape)
        else:
            local, values = param, full
        if tuple(values.shape) != tuple(local.shape):
            raise ConfigError(
                f"parameter {name}: cannot copy a {list(values.shape)} tensor into a {list(local.shape)} shard"
            )
        local.detach().copy_(values.to(device=local.device, dtype=local.dtype))
        count += 1
    return count


def init_from_hf(named_parameters, spec: models.ModelSpec, model_args, source: str | Path, recipe_model: str) -> None:
    """Load the HF folder `source` into these parameters (this rank's, of any layout), after checking that
    it holds the model `model_args` describe (`recipe_model` names it in errors, e.g. "llama3 debug")."""
    source = Path(source)
    spec = hf_spec(spec.name)
    try:
        hf_args, state, file_dtype = load_hf(source, spec)
    except ConfigError as e:
        raise ConfigError(f"checkpoint.init_from_hf: {e}") from None
    check_model_matches(spec, model_args, hf_args, state, f"checkpoint.init_from_hf {source}", recipe_model)
    count = copy_into_parameters(named_parameters, state)
    n_params = sum(math.prod(s) for s in model_shapes(spec, hf_args).values())
    log.info(
        "initialised the model from HF checkpoint %s: %d parameter tensors on this rank (model: %.2fM parameters, "
        "%s in the files)",
        source,
        count,
        n_params / 1e6,
        file_dtype,
    )
